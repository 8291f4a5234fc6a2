//! The learner's RPCs, and what it serves before it can train.
//!
//! Before the learner can train it waits for its run on the orchestrator,
//! fetches a start model, meets its ranks and loads the weights: minutes. It
//! serves all along, so readiness probes and `helm install --wait` see a
//! live pod that says which of those steps it is on (gRPC health
//! NOT_SERVING, the step in the log; RPCs UNAVAILABLE naming it) instead of
//! a socket that never answers.

use std::sync::{Arc, Mutex};

use sleuth_proto::learner::v1 as pb;
use sleuth_proto::learner::v1::learner_server::Learner;
use sleuth_store::{ObjectStore, RedisStore};
use tonic::{Request, Response, Status};

use crate::checkpoint;
use crate::config::Mode;
use crate::learn::SharedProgress;

/// The RPC handlers: status and checkpoints.
#[derive(Clone)]
pub struct Handlers {
    pub(crate) run_id: String,
    pub(crate) mode: Mode,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) progress: SharedProgress,
    pub(crate) checkpoints: ObjectStore,
    pub(crate) redis: RedisStore,
}

#[tonic::async_trait]
impl Learner for Handlers {
    async fn get_status(&self, _: Request<pb::GetStatusRequest>) -> Result<Response<pb::LearnerStatus>, Status> {
        let progress = self.progress.lock().expect("progress").clone();
        let consumer =
            sleuth_store::trajectories::GroupConsumer::open(self.redis.clone(), &self.run_id, "learner-0").await;
        let (pending, lag) = match consumer {
            Ok(consumer) => consumer.backlog().await.unwrap_or_default(),
            Err(_) => (0, 0),
        };
        let last = progress.last.map(|s| serde_json::to_value(s).unwrap_or_default()).unwrap_or_default();
        let last_step_metrics = last
            .as_object()
            .map(|o| o.iter().filter_map(|(k, v)| Some((k.clone(), v.as_f64()?))).collect())
            .unwrap_or_default();
        Ok(Response::new(pb::LearnerStatus {
            run_id: self.run_id.clone(),
            mode: match self.mode {
                Mode::Rl => pb::TrainingMode::Rl as i32,
                Mode::Sft => pb::TrainingMode::Sft as i32,
            },
            step: progress.meta.step,
            policy_version: progress.meta.step,
            world_size: self.world as u32,
            rank: self.rank as u32,
            groups_consumed: progress.meta.groups_consumed,
            groups_pending: pending + lag,
            groups_dropped_stale: progress.meta.groups_dropped_stale,
            last_step_metrics,
            last_checkpoint_step: progress.last_checkpoint_step,
        }))
    }

    async fn list_checkpoints(
        &self,
        _: Request<pb::ListCheckpointsRequest>,
    ) -> Result<Response<pb::ListCheckpointsResponse>, Status> {
        let steps = checkpoint::complete_steps(&self.checkpoints)
            .await
            .map_err(|e| Status::unavailable(format!("listing checkpoints in {}: {e}", self.checkpoints.uri())))?;
        let base = self.checkpoints.uri();
        let checkpoints = steps
            .into_iter()
            .map(|step| pb::Checkpoint {
                step,
                uri: format!("{base}/{}", checkpoint::step_dir(step)),
                hf_export_uri: format!("{base}/{}/hf", checkpoint::step_dir(step)),
                complete: true,
                ..Default::default()
            })
            .collect();
        Ok(Response::new(pb::ListCheckpointsResponse { checkpoints }))
    }
}

/// The learner's service from its first moment: [`Handlers`] once
/// [`Starting::ready`], until then the step it is on.
#[derive(Clone)]
pub struct Starting {
    state: Arc<Mutex<State>>,
}

enum State {
    Step(String),
    Ready(Arc<Handlers>),
}

impl Starting {
    /// A learner on its first step.
    pub fn new(step: impl Into<String>) -> Self {
        let step = step.into();
        tracing::info!(%step, "starting");
        Self { state: Arc::new(Mutex::new(State::Step(step))) }
    }

    /// Moves on to the next step before training.
    pub fn step(&self, step: impl Into<String>) {
        let step = step.into();
        tracing::info!(%step, "starting");
        *self.state.lock().expect("starting state") = State::Step(step);
    }

    /// The learner trains: its RPCs answer from now on.
    pub fn ready(&self, handlers: Handlers) {
        *self.state.lock().expect("starting state") = State::Ready(Arc::new(handlers));
    }

    /// Readiness: failing with the current step until [`Starting::ready`].
    pub fn probe(&self) -> Arc<dyn sleuth_kit::Probe> {
        let starting = self.clone();
        sleuth_kit::health::probe_fn("learner", move || {
            let outcome = starting.handlers().map(drop).map_err(|status| status.message().to_owned());
            Box::pin(std::future::ready(outcome))
        })
    }

    fn handlers(&self) -> Result<Arc<Handlers>, Status> {
        match &*self.state.lock().expect("starting state") {
            State::Ready(handlers) => Ok(handlers.clone()),
            State::Step(step) => Err(Status::unavailable(format!("the learner is starting: {step}"))),
        }
    }
}

#[tonic::async_trait]
impl Learner for Starting {
    async fn get_status(&self, request: Request<pb::GetStatusRequest>) -> Result<Response<pb::LearnerStatus>, Status> {
        self.handlers()?.get_status(request).await
    }

    async fn list_checkpoints(
        &self,
        request: Request<pb::ListCheckpointsRequest>,
    ) -> Result<Response<pb::ListCheckpointsResponse>, Status> {
        self.handlers()?.list_checkpoints(request).await
    }
}
