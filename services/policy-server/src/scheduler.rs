//! The scheduler actor: owns the model, its weights and the batch KV cache on
//! a dedicated thread, and runs continuous batching.
//!
//! Between two decode steps it (1) takes new commands, (2) applies a pending
//! weight update (so every token of a step comes from one version), (3)
//! admits waiting requests while a batch row is free and the KV budget allows
//! their whole length (prompt + max_new_tokens), prefilling each, then (4)
//! decodes one token for every running sequence. Requests beyond the batch
//! wait in a bounded queue; past it they are refused with `ResourceExhausted`,
//! so load never turns into an out-of-memory crash.

use std::collections::VecDeque;
use std::path::Path;

use sleuth_model::sampling::{Rng, Sampled, Sampling, sample, sample_rows};
use sleuth_model::{BatchCache, Config, KvCache, Model, load_weights};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use tokio::sync::mpsc;

use crate::engine::{Command, Event, Finish, Job, Limits, ModelFacts, RawTensor, Weights};
use crate::error::Error;
use crate::metrics::METRICS;
use crate::sessions::Sessions;

/// Padded tokens prefilled together at most when several requests join at once.
const PREFILL_TOKENS: usize = 8192;

struct Waiting {
    job: Job,
    events: mpsc::UnboundedSender<Result<Event, Error>>,
}

struct Running {
    job: Job,
    events: mpsc::UnboundedSender<Result<Event, Error>>,
    rng: Rng,
    last: i64,
    /// Sampled tokens so far; all but the last are in the KV cache.
    generated: Vec<i64>,
    /// Prompt tokens whose keys and values came from the session's cache.
    cached_prompt: usize,
}

impl Running {
    /// The tokens whose keys and values the sequence's cache holds.
    fn cached_tokens(&self) -> Vec<i64> {
        let fed = self.generated.len().saturating_sub(1);
        self.job.prompt.iter().chain(&self.generated[..fed]).copied().collect()
    }
}

pub(crate) struct Scheduler {
    model: Model,
    vars: VarStore,
    facts: ModelFacts,
    limits: Limits,
    waiting: VecDeque<Waiting>,
    /// Running sequences; `running[r]` decodes in batch row `r`.
    running: Vec<Running>,
    /// KV tokens reserved by running sequences.
    reserved: usize,
    kind: Kind,
    sessions: Sessions,
}

impl Scheduler {
    pub(crate) fn load(dir: &Path, config: Config, device: Device, kind: Kind, limits: Limits) -> Result<Self, Error> {
        sleuth_torch::set_intra_op_threads(limits.torch_threads);
        let mut vars = VarStore::new(device);
        let model = Model::new(&vars.root(), &config);
        load_weights(&mut vars, dir)?;
        if kind != Kind::Float {
            vars.set_kind(kind);
        }
        vars.freeze();
        let facts = ModelFacts {
            model_id: dir.file_name().and_then(|n| n.to_str()).unwrap_or("model").to_owned(),
            architecture: config.model_type.clone(),
            num_parameters: vars.variables().values().map(|t| t.numel() as u64).sum(),
            kind,
            device,
            vocab_size: config.vocab_size as u32,
            max_position_embeddings: config.max_position_embeddings as u32,
            eos_token_ids: config.eos_token_ids(),
            version: 0,
            run: String::new(),
            kv_budget_tokens: limits.kv_budget_tokens as u64,
            parameters: std::sync::Arc::new(vars.variables().into_iter().map(|(name, t)| (name, t.size())).collect()),
        };
        Ok(Scheduler {
            model,
            vars,
            facts,
            limits,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reserved: 0,
            kind,
            sessions: Sessions::new(limits.prefix_cache_tokens),
        })
    }

    pub(crate) fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        let mut batch = BatchCache::new(&self.model.config, self.limits.max_batch, self.kind, self.facts.device);
        loop {
            // Idle: block for work. Busy: take whatever arrived since the last step.
            if self.running.is_empty() && self.waiting.is_empty() {
                match commands.blocking_recv() {
                    Some(command) => self.handle(command, &mut batch),
                    None => return,
                }
            }
            while let Ok(command) = commands.try_recv() {
                self.handle(command, &mut batch);
            }
            self.admit(&mut batch);
            if !self.running.is_empty() {
                let started = std::time::Instant::now();
                self.step(&mut batch);
                METRICS.decode_step_seconds.observe(started.elapsed().as_secs_f64());
            }
            METRICS.batch_size.set(self.running.len() as i64);
            METRICS.queue_depth.set(self.waiting.len() as i64);
            METRICS.kv_reserved_tokens.set(self.reserved as i64);
            METRICS.prefix_cache_tokens.set(self.sessions.held as i64);
        }
    }

    fn handle(&mut self, command: Command, batch: &mut BatchCache) {
        match command {
            Command::Generate { job, events } => {
                if let Err(behind) = self.facts.may_sample(&job) {
                    let _ = events.send(Err(behind));
                } else if self.waiting.len() >= self.limits.max_queue {
                    METRICS.refused_requests.inc();
                    let _ = events.send(Err(Error::Overloaded(format!(
                        "{} requests are already waiting for the batch",
                        self.waiting.len()
                    ))));
                } else {
                    self.waiting.push_back(Waiting { job, events });
                }
            }
            Command::Update { run, version, weights, reply } => {
                let updated = self.update(run, version, weights);
                if updated.is_ok() {
                    self.refill(batch);
                }
                let _ = reply.send(updated);
            }
            Command::Facts { reply } => {
                let _ = reply.send(self.facts.clone());
            }
        }
    }

    /// Validates and copies new weights into the model; all or nothing.
    fn update(&mut self, run: String, version: u64, weights: Weights) -> Result<u64, Error> {
        self.facts.may_take(&run, version)?;
        match weights {
            Weights::Checkpoint(dir) => {
                let config = Config::from_file(&dir.join("config.json"))?;
                if config.hidden_size != self.model.config.hidden_size
                    || config.num_hidden_layers != self.model.config.num_hidden_layers
                    || config.vocab_size != self.model.config.vocab_size
                {
                    return Err(Error::InvalidArgument(format!(
                        "checkpoint {} has a different shape than the served model",
                        dir.display()
                    )));
                }
                // Load into a scratch store first so a bad checkpoint leaves the served weights untouched.
                let mut scratch = VarStore::new(self.facts.device);
                let _shape = Model::new(&scratch.root(), &self.model.config);
                load_weights(&mut scratch, &dir)?;
                self.vars.copy(&scratch).map_err(|e| Error::Internal(e.to_string()))?;
            }
            Weights::Tensors(tensors) => {
                let variables = self.vars.variables();
                for RawTensor { name, shape, .. } in &tensors {
                    let Some(target) = variables.get(name) else {
                        return Err(Error::InvalidArgument(format!("tensor {name:?} is not a parameter of the model")));
                    };
                    if &target.size() != shape {
                        return Err(Error::InvalidArgument(format!(
                            "tensor {name:?} has shape {shape:?}, the model's is {:?}",
                            target.size()
                        )));
                    }
                }
                for RawTensor { name, kind, shape, data } in tensors {
                    let tensor = Tensor::from_data_size(&data, &shape, kind);
                    let mut target = variables[&name].shallow_clone();
                    target.copy_(&tensor.to_kind(target.kind()).to_device(target.device()));
                }
            }
        }
        if run != self.facts.run {
            tracing::warn!(run, replaced = self.facts.run, "weights of another run replace the served ones");
        }
        self.facts.version = version;
        self.facts.run = run;
        METRICS.policy_version.set(version as i64);
        self.sessions.clear();
        tracing::info!(version, run = self.facts.run, "weights updated");
        Ok(version)
    }

    /// After a weight update: refuses the waiting and running jobs the new
    /// weights may not sample (another run's, see [`ModelFacts::may_sample`])
    /// with the reason, as if they had arrived now; nothing they sampled so
    /// far reaches their caller as an answer, so it may ask another replica.
    /// Called by [`Self::refill`] while the batch holds no row.
    fn drop_unservable(&mut self) {
        let facts = &self.facts;
        self.waiting.retain(|waiting| match facts.may_sample(&waiting.job) {
            Ok(()) => true,
            Err(behind) => {
                let _ = waiting.events.send(Err(behind));
                false
            }
        });
        for row in (0..self.running.len()).rev() {
            if let Err(behind) = self.facts.may_sample(&self.running[row].job) {
                let gone = self.running.swap_remove(row);
                self.reserved -= gone.job.prompt.len() + gone.job.max_new_tokens;
                let _ = gone.events.send(Err(behind));
            }
        }
    }

    /// After a weight update: recomputes the keys and values of every running
    /// sequence with the new weights, so each token sampled from now on comes
    /// from the new version alone, as its recorded version says. (Decoding on
    /// keys and values the old weights wrote gave logprobs of neither
    /// version: the learner could not reproduce them.) Sequences the new
    /// weights may not sample are dropped instead ([`Self::drop_unservable`]).
    fn refill(&mut self, batch: &mut BatchCache) {
        for row in (0..self.running.len()).rev() {
            batch.remove(row);
        }
        self.drop_unservable();
        for running in &self.running {
            let tokens = running.cached_tokens();
            let length = tokens.len() as i64;
            let ids = Tensor::from_slice(&tokens).to_device(self.facts.device).unsqueeze(0);
            let (_, cache) = self.model.prefill(&ids, &[length]);
            if let Err(message) = batch.insert(&cache.row(0, length)) {
                // Cannot happen: the batch held these sequences a moment ago.
                tracing::error!(message, "refilling the batch after a weight update");
            }
        }
    }

    /// Admits waiting requests that fit, prefilling those without a reusable
    /// session prefix together (right-padded, in groups of at most
    /// [`PREFILL_TOKENS`] padded tokens) and the others on top of their prefix.
    fn admit(&mut self, batch: &mut BatchCache) {
        let mut admitted = Vec::new();
        let mut reserved = self.reserved;
        while batch.active() + admitted.len() < batch.slots() {
            let Some(next) = self.waiting.front() else { break };
            let need = next.job.prompt.len() + next.job.max_new_tokens;
            if reserved + need > self.limits.kv_budget_tokens && !(self.running.is_empty() && admitted.is_empty()) {
                break; // wait for running sequences to finish and free their reservation
            }
            let waiting = self.waiting.pop_front().expect("front exists");
            if !waiting.events.is_closed() {
                reserved += need;
                admitted.push(waiting);
            }
        }
        let mut fresh = Vec::new();
        for Waiting { job, events } in admitted {
            // Reuse the session's cached prefix; at least the last prompt token is fed for its logits.
            let reusable = self.sessions.take(&job.session).and_then(|(tokens, mut cache)| {
                let shared =
                    tokens.iter().zip(&job.prompt).take_while(|(a, b)| a == b).count().min(job.prompt.len() - 1);
                cache.truncate(shared as i64);
                (shared > 0).then_some((cache, shared))
            });
            match reusable {
                Some((mut cache, shared)) => {
                    let suffix = Tensor::from_slice(&job.prompt[shared..]).to_device(self.facts.device).unsqueeze(0);
                    let logits = self.model.extend(&suffix, &mut cache);
                    self.start(job, events, cache, shared, &logits.get(0), batch);
                }
                None => fresh.push((job, events)),
            }
        }
        fresh.sort_by_key(|(job, _)| job.prompt.len());
        while !fresh.is_empty() {
            // The longest prefix of the (length-sorted) list whose padded size fits a group.
            let count = (1..=fresh.len())
                .take_while(|&n| n * fresh[n - 1].0.prompt.len() <= PREFILL_TOKENS)
                .last()
                .unwrap_or(1);
            let group: Vec<_> = fresh.drain(..count).collect();
            let longest = group.iter().map(|(job, _)| job.prompt.len()).max().unwrap_or(0);
            let lengths: Vec<i64> = group.iter().map(|(job, _)| job.prompt.len() as i64).collect();
            let padded: Vec<i64> = group
                .iter()
                .flat_map(|(job, _)| job.prompt.iter().copied().chain(std::iter::repeat(0)).take(longest))
                .collect();
            let ids =
                Tensor::from_slice(&padded).view([group.len() as i64, longest as i64]).to_device(self.facts.device);
            let (logits, cache) = self.model.prefill(&ids, &lengths);
            for (row, (job, events)) in group.into_iter().enumerate() {
                let length = lengths[row];
                self.start(job, events, cache.row(row, length), 0, &logits.get(row as i64), batch);
            }
        }
    }

    /// Samples a prefilled request's first token and, unless that ends it, adds it to the batch.
    fn start(
        &mut self,
        job: Job,
        events: mpsc::UnboundedSender<Result<Event, Error>>,
        cache: KvCache,
        cached_prompt: usize,
        logits: &Tensor,
        batch: &mut BatchCache,
    ) {
        let need = job.prompt.len() + job.max_new_tokens;
        METRICS.prompt_tokens.inc_by(job.prompt.len() as u64);
        METRICS.cached_prompt_tokens.inc_by(cached_prompt as u64);
        let mut running =
            Running { rng: Rng::new(job.seed), job, events, last: 0, generated: Vec::new(), cached_prompt };
        if emit(&self.facts, &mut running, logits) {
            if self.limits.prefix_cache_tokens > 0 {
                self.sessions.keep(&running.job.session, running.job.prompt.clone(), cache);
            }
            return;
        }
        if let Err(message) = batch.insert(&cache) {
            let _ = running.events.send(Err(Error::Internal(message)));
            return;
        }
        self.reserved += need;
        self.running.push(running);
    }

    fn step(&mut self, batch: &mut BatchCache) {
        sleuth_kit::fault::point("policy-scheduler-step");
        let tokens: Vec<i64> = self.running.iter().map(|r| r.last).collect();
        let logits = self.model.decode_step(&tokens, batch);
        let sampled = {
            let mut rows: Vec<(&Sampling, &mut Rng)> =
                self.running.iter_mut().map(|r| (&r.job.sampling, &mut r.rng)).collect();
            sample_rows(&logits, &mut rows)
        };
        let mut finished = Vec::new();
        for (row, (running, sampled)) in self.running.iter_mut().zip(sampled).enumerate() {
            if record(&self.facts, running, sampled) {
                finished.push(row);
            }
        }
        // Highest rows first, so moving the last row down never moves a finished one.
        for row in finished.into_iter().rev() {
            let done = self.running.swap_remove(row);
            self.reserved -= done.job.prompt.len() + done.job.max_new_tokens;
            if !done.job.session.is_empty() && self.limits.prefix_cache_tokens > 0 {
                self.sessions.keep(&done.job.session, done.cached_tokens(), batch.extract(row));
            }
            batch.remove(row);
        }
    }
}

/// Samples the next token of `running` from `logits` and sends it; true when
/// the sequence is finished (stop token, length, or the caller went away).
fn emit(facts: &ModelFacts, running: &mut Running, logits: &Tensor) -> bool {
    let sampled = sample(logits, &running.job.sampling, &mut running.rng);
    record(facts, running, sampled)
}

/// Sends a sampled token; true when the sequence is finished.
fn record(facts: &ModelFacts, running: &mut Running, sampled: Sampled) -> bool {
    running.last = i64::from(sampled.token);
    running.generated.push(running.last);
    METRICS.generated_tokens.inc();
    let _ = running.events.send(Ok(Event::Token { sampled, version: facts.version }));
    let stopped = running.job.stop_tokens.contains(&sampled.token)
        || facts.eos_token_ids.contains(&sampled.token)
        || running.job.stop_strings.as_ref().is_some_and(|stop| stop.reached(&running.generated));
    let length = running.generated.len() >= running.job.max_new_tokens;
    if stopped || length {
        let finish = if stopped { Finish::Stop } else { Finish::Length };
        let _ = running.events.send(Ok(Event::Done {
            finish,
            prompt_tokens: running.job.prompt.len(),
            cached_prompt_tokens: running.cached_prompt,
        }));
        return true;
    }
    running.events.is_closed()
}
