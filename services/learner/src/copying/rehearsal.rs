//! Copy rehearsal: copy pre-training's conversations (ask and bridge, over
//! the run's own collection) added to every step of trajectory SFT, when the
//! spec's `training.copy_rehearsal` asks for them.
//!
//! Why: SFT on teacher episodes teaches a small policy to recall a bridge
//! instead of copying it. Measured on the synth collection (548 training
//! questions over 137 companies, each founder in a dozen episodes): the
//! fresh policy copied 11 of 16 held-out bridges exactly, yet after SFT 35 of
//! its 65 greedy bridges on validation questions were names nowhere in the
//! results (a training question's founder), and 6 the teacher's. The
//! rehearsed conversations name random documents, so only copying answers
//! them: every step then rewards the skill the episodes need on new
//! questions, the way pre-training data mixed into RLHF keeps a model's
//! pre-trained skills (InstructGPT's PPO-ptx).
//!
//! Only what follows a reply's tool name is trained: whether to search again
//! or submit is the teacher's and GRPO's to teach. Random documents nearly
//! always name someone new, so whole rehearsed replies said "search again"
//! almost every time, and the policy learnt to search until its turns ran
//! out (13 to 30 % of validation episodes, measured in `make demo`).

use std::path::{Path, PathBuf};

use super::conversation::{Draw, Offered, Source, Teach, conversation_sample};
use crate::Error;
use crate::batch::Sample;
use crate::reply::ReplyRenderer;

/// What a run rehearses, from its spec.
#[derive(Debug, Clone, PartialEq)]
pub struct RehearsalSpec {
    /// Conversations added to every step.
    pub per_step: usize,
    /// The BEIR directory of the run's training tasks (`train.source_uri`).
    pub collection: PathBuf,
    /// Its training split: the questions a third of the conversations ask.
    pub split: String,
    /// The tools the run's agent offers (`agent.tools`), as its episodes
    /// show them.
    pub tools: Vec<String>,
    /// Seed of the conversations drawn (each step's from it and the step).
    pub seed: u64,
}

/// Draws each step's rehearsed conversations.
pub struct Rehearsal {
    source: Source,
    renderer: ReplyRenderer,
    per_step: usize,
    seed: u64,
}

impl std::fmt::Debug for Rehearsal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rehearsal")
            .field("per_step", &self.per_step)
            .field("documents", &self.source.documents())
            .finish()
    }
}

impl Rehearsal {
    /// Reads the collection of `spec` and the tokenizer and chat template of
    /// the model in `model_dir`.
    pub fn new(model_dir: &Path, spec: &RehearsalSpec) -> Result<Self, Error> {
        let invalid = |message: String| {
            Error::InvalidArgument(format!(
                "spec.training.copy_rehearsal reads spec.train.source_uri {}: {message}",
                spec.collection.display()
            ))
        };
        let (documents, questions) =
            super::documents_and_questions(&spec.collection, &spec.split).map_err(|e| invalid(e.to_string()))?;
        if documents.len() < 2 {
            return Err(invalid(format!("{} documents; rehearsal needs at least 2", documents.len())));
        }
        let tools = Offered::new(&spec.tools)
            .map_err(|e| Error::InvalidArgument(format!("spec.training.copy_rehearsal with spec.agent.tools: {e}")))?;
        Ok(Self {
            source: Source::new(documents, questions, tools),
            renderer: ReplyRenderer::from_dir(model_dir)?,
            per_step: spec.per_step,
            seed: spec.seed,
        })
    }

    /// The conversations rehearsed in `step`: the same for the same step, so
    /// a learner resumed from a checkpoint trains what it would have.
    pub fn samples(&self, step: u64) -> Result<Vec<Sample>, Error> {
        let mut draw = Draw::new(sleuth_kit::seed::derive(self.seed, &step.to_string()));
        (0..self.per_step)
            .map(|i| conversation_sample(&self.source, &self.renderer, i, &mut draw, Teach::Writing))
            .collect()
    }
}
