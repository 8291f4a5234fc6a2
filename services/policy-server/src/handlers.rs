//! gRPC handlers: validation and translation between the proto and the engine.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use futures::StreamExt;
use sleuth_model::sampling::Sampling;
use sleuth_proto::policy::v1 as pb;
use sleuth_proto::policy::v1::policy_server_server::PolicyServer;
use tch::Kind;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument as _;

use crate::engine::{Engine, Event, Finish, Job, StopStrings, Weights};
use crate::error::Error;
use crate::weights::Assembly;

pub struct Handlers {
    /// The model, once loaded (or why it could not be).
    pub engine: Arc<OnceLock<Result<Engine, String>>>,
    /// Where `s3://` checkpoints are fetched from.
    pub s3: sleuth_store::S3Args,
    /// The directories a local checkpoint may lie in (see [`crate::Config::checkpoint_roots`]).
    pub checkpoint_roots: sleuth_store::LocalRoots,
}

impl Handlers {
    fn engine(&self) -> Result<&Engine, Error> {
        match self.engine.get() {
            Some(Ok(engine)) => Ok(engine),
            Some(Err(error)) => Err(Error::Internal(format!("the model failed to load: {error}"))),
            None => Err(Error::Overloaded("the model is still loading".to_owned())),
        }
    }

    /// Checks a request against the model, naming the offending field.
    fn job(&self, request: &pb::GenerateRequest) -> Result<(Job, bool), Error> {
        let engine = self.engine()?;
        let vocab = engine.config.vocab_size;
        let context = engine.config.max_position_embeddings as usize;
        if request.prompt_token_ids.is_empty() {
            return Err(Error::InvalidArgument("prompt_token_ids must not be empty".to_owned()));
        }
        if let Some((index, id)) = request.prompt_token_ids.iter().enumerate().find(|(_, id)| i64::from(**id) >= vocab)
        {
            return Err(Error::InvalidArgument(format!(
                "prompt_token_ids[{index}] = {id} is outside the vocabulary ({vocab} tokens)"
            )));
        }
        let params = request.sampling.clone().unwrap_or_default();
        let max_new_tokens = params.max_new_tokens as usize;
        if max_new_tokens == 0 {
            return Err(Error::InvalidArgument("sampling.max_new_tokens must be at least 1, got 0".to_owned()));
        }
        if request.prompt_token_ids.len() + max_new_tokens > context {
            return Err(Error::InvalidArgument(format!(
                "prompt of {} tokens plus sampling.max_new_tokens {max_new_tokens} exceeds the context of {context} tokens",
                request.prompt_token_ids.len()
            )));
        }
        let need = request.prompt_token_ids.len() + max_new_tokens;
        if need > engine.limits.kv_budget_tokens {
            return Err(Error::InvalidArgument(format!(
                "prompt of {} tokens plus sampling.max_new_tokens {max_new_tokens} exceeds the KV budget of {} tokens",
                request.prompt_token_ids.len(),
                engine.limits.kv_budget_tokens
            )));
        }
        let sampling = Sampling {
            temperature: params.temperature.unwrap_or(1.0),
            top_p: params.top_p.unwrap_or(1.0),
            top_k: params.top_k as usize,
        };
        sampling.validate().map_err(|message| Error::InvalidArgument(format!("sampling.{message}")))?;
        let stop_strings = StopStrings::new(&params.stop, engine.tokenizer.as_ref())
            .map_err(|message| Error::InvalidArgument(format!("sampling.{message}")))?;
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        });
        let job = Job {
            session: request.session_id.clone(),
            prompt: request.prompt_token_ids.iter().map(|&id| i64::from(id)).collect(),
            sampling,
            seed,
            max_new_tokens,
            stop_tokens: params.stop_token_ids.clone(),
            stop_strings,
            min_version: request.min_policy_version,
            run: request.run_id.clone(),
        };
        Ok((job, request.return_model_logprobs))
    }
}

fn finish_reason(finish: Finish) -> i32 {
    match finish {
        Finish::Stop => pb::FinishReason::Stop as i32,
        Finish::Length => pb::FinishReason::Length as i32,
    }
}

#[tonic::async_trait]
impl PolicyServer for Handlers {
    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<pb::GenerateResponse>, Status> {
        let span = tracing::info_span!(
            "generate",
            episode_id = %request.get_ref().session_id,
            prompt_tokens = request.get_ref().prompt_token_ids.len(),
            policy_version = tracing::field::Empty,
        );
        self.generated(request).instrument(span).await
    }
    async fn generate_stream(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<BoxStream<pb::GenerateChunk>>, Status> {
        let (job, with_model_logprobs) = self.job(request.get_ref())?;
        let engine = self.engine()?.clone();
        let events = engine.generate(job)?;
        // A stream the scheduler drops without a finish (it died) ends with UNAVAILABLE, never silently.
        let events = futures::stream::unfold((events, false), move |(mut events, ended)| {
            let engine = engine.clone();
            async move {
                if ended {
                    return None;
                }
                let event = events.recv().await.unwrap_or_else(|| Err(engine.stopped()));
                let ended = !matches!(event, Ok(Event::Token { .. }));
                Some((event, (events, ended)))
            }
        });
        let chunks = events.map(move |event| match event {
            Ok(Event::Token { sampled, version }) => Ok(pb::GenerateChunk {
                token_ids: vec![sampled.token],
                logprobs: vec![sampled.logprob],
                model_logprobs: if with_model_logprobs { vec![sampled.model_logprob] } else { Vec::new() },
                policy_versions: vec![version],
                ..Default::default()
            }),
            Ok(Event::Done { finish, prompt_tokens, cached_prompt_tokens }) => Ok(pb::GenerateChunk {
                finish_reason: finish_reason(finish),
                prompt_tokens: prompt_tokens as u32,
                cached_prompt_tokens: cached_prompt_tokens as u32,
                ..Default::default()
            }),
            Err(error) => Err(Status::from(error)),
        });
        Ok(Response::new(Box::pin(chunks)))
    }

    async fn update_weights(
        &self,
        request: Request<Streaming<pb::UpdateWeightsRequest>>,
    ) -> Result<Response<pb::UpdateWeightsResponse>, Status> {
        let engine = self.engine()?;
        let mut stream = request.into_inner();
        let header = match stream.message().await?.and_then(|m| m.part) {
            Some(pb::update_weights_request::Part::Header(header)) => header,
            _ => return Err(Error::InvalidArgument("the first message must be a WeightsHeader".to_owned()).into()),
        };
        let started = Instant::now();
        let mut bytes_received = 0u64;
        // An s3:// checkpoint is fetched into a scratch directory that lives until the swap is done.
        let mut fetched = None;
        let weights = if !header.checkpoint_uri.is_empty() {
            if header.checkpoint_uri.starts_with("s3://") {
                let scratch = tempfile::tempdir().map_err(|e| Error::Internal(e.to_string()))?;
                // A checkpoint of the served model holds its parameters in f32 at
                // most, beside a tokenizer and configuration far below 64 MiB.
                let limit = engine.facts().await?.num_parameters * 4 + (64 << 20);
                sleuth_store::object::fetch_model_dir(&header.checkpoint_uri, &self.s3, scratch.path(), Some(limit))
                    .await
                    .map_err(|e| Error::InvalidArgument(format!("checkpoint_uri {:?}: {e}", header.checkpoint_uri)))?;
                let path = scratch.path().to_owned();
                fetched = Some(scratch);
                Weights::Checkpoint(path)
            } else {
                let uri = &header.checkpoint_uri;
                let path = std::path::Path::new(uri.strip_prefix("file://").unwrap_or(uri));
                Weights::Checkpoint(self.checkpoint_roots.confine(uri, path).map_err(Error::from)?)
            }
        } else {
            let facts = engine.facts().await?;
            let mut assembly = Assembly::new(&facts.parameters, header.tensor_count)?;
            while let Some(message) = stream.message().await? {
                let Some(pb::update_weights_request::Part::Tensor(chunk)) = message.part else {
                    return Err(Error::InvalidArgument("only one WeightsHeader may be sent".to_owned()).into());
                };
                assembly.add(chunk)?;
            }
            bytes_received = assembly.bytes_received;
            let tensors = assembly.finish()?;
            Weights::Tensors(tensors)
        };
        let tensors_updated = match &weights {
            Weights::Tensors(tensors) => tensors.len() as u32,
            Weights::Checkpoint(_) => 0,
        };
        let version = engine.update(header.run_id.clone(), header.version, weights).await?;
        drop(fetched);
        Ok(Response::new(pb::UpdateWeightsResponse {
            version,
            tensors_updated,
            bytes_received,
            swap_micros: started.elapsed().as_micros() as u64,
        }))
    }

    async fn get_model_info(&self, _: Request<pb::GetModelInfoRequest>) -> Result<Response<pb::ModelInfo>, Status> {
        let facts = self.engine()?.facts().await?;
        Ok(Response::new(pb::ModelInfo {
            model_id: facts.model_id,
            architecture: facts.architecture,
            num_parameters: facts.num_parameters,
            dtype: if facts.kind == Kind::BFloat16 { pb::DType::DtypeBf16 as i32 } else { pb::DType::DtypeF32 as i32 },
            device: sleuth_torch::device_name(facts.device),
            vocab_size: facts.vocab_size,
            max_position_embeddings: facts.max_position_embeddings,
            eos_token_ids: facts.eos_token_ids,
            policy_version: facts.version,
            kv_cache_budget_tokens: facts.kv_budget_tokens,
            libtorch_version: String::new(),
            run_id: facts.run,
        }))
    }
}

impl Handlers {
    /// A whole generation, answered once it ends.
    async fn generated(&self, request: Request<pb::GenerateRequest>) -> Result<Response<pb::GenerateResponse>, Status> {
        let (job, with_model_logprobs) = self.job(request.get_ref())?;
        let engine = self.engine()?;
        let mut events = engine.generate(job)?;
        let mut response = pb::GenerateResponse::default();
        while let Some(event) = events.recv().await {
            match event? {
                Event::Token { sampled, version } => {
                    response.token_ids.push(sampled.token);
                    response.logprobs.push(sampled.logprob);
                    if with_model_logprobs {
                        response.model_logprobs.push(sampled.model_logprob);
                    }
                    response.policy_versions.push(version);
                }
                Event::Done { finish, prompt_tokens, cached_prompt_tokens } => {
                    response.finish_reason = finish_reason(finish);
                    response.prompt_tokens = prompt_tokens as u32;
                    response.cached_prompt_tokens = cached_prompt_tokens as u32;
                    if let Some(version) = response.policy_versions.last() {
                        tracing::Span::current().record("policy_version", version);
                    }
                    return Ok(Response::new(response));
                }
            }
        }
        // Events end without a finish only when the scheduler thread died mid-generation.
        Err(engine.stopped().into())
    }
}
