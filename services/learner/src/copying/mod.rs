//! Copy pre-training: teaches a fresh policy to copy text into its tool
//! calls before it sees a single question, from the collection's documents
//! alone (no questions, no relevance judgements).
//!
//! Why: a policy of a few million parameters trained by SFT on teacher
//! episodes alone memorises instead of copying. Measured on the synth
//! collection: asked about "Ruklai Foundry", it searched for a name it had
//! seen in training, and submitted ids from memory; held-out nDCG@10 was 0.
//! Nothing in a few thousand episodes forces it to learn the one skill every
//! search turn needs, copying an unseen name from the conversation. Here the
//! names come from random documents in random combinations, so memorising
//! cannot work and copying is the only way to lower the loss.
//!
//! Half of every step is raw text: a string of random words, then the
//! same string again, with the loss on the repeat. Only copying predicts it,
//! at every token, so this is where the copying circuit (induction heads)
//! forms. Conversations alone, a few copied words each, did not form it in
//! thousands of steps (measured: 0 exact copies of held-out questions).
//!
//! The other half are conversations in the agent protocol's own text
//! (`sleuth_chat`'s tool calls and search observations), two tasks:
//! - ask: the user's message (a training question, a document sentence
//!   or random words) becomes a search query, verbatim;
//! - bridge: after a search, the next search is the most salient name in
//!   the results that no earlier query holds (the teacher's bridge rule;
//!   with `follow_lead` offered, a listed lead drawn uniformly, by its
//!   number), or a submission (without ids: the agent ranks what the
//!   searches found) when there is none.
//!
//! Conversations open with the agent's system prompt (`sleuth_chat`) and the
//! tools the agent will offer (`--tools`), as the model's own template
//! renders them (a fresh policy's names them in one line): the context the
//! policy copies in during its episodes. A bridge's first search is the
//! question's, as the agent's `opening_search` shows it. Which task an episode
//! needs, and when, is left to SFT and RL.

use std::path::Path;
use std::time::Instant;

use sleuth_beir::{BadLines, BeirDir, BeirError, Document};
use sleuth_metrics::schedule::LrSchedule;

use crate::Error;
use crate::reply::{ReplyRenderer, predict_reply, save_trained, sft_trainer};
use crate::shard::AdamW;
use crate::trainer::Trainer;

mod conversation;
mod rehearsal;

pub use conversation::Task;
use conversation::{Draw, Offered, Source, Teach, conversation, conversation_sample, repeated};
pub use rehearsal::{Rehearsal, RehearsalSpec};
/// Conversations per forward pass.
const MICRO_BATCH: usize = 8;
/// Held-out conversations scored per task at each progress report.
const SCORED: usize = 16;

/// How long and how hard to pre-train.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyTraining {
    /// Optimizer steps; 0 skips copy pre-training.
    pub steps: usize,
    /// Samples per step (half repeated strings, half conversations).
    pub batch: usize,
    /// Peak learning rate (AdamW; warm-up, then cosine decay to a tenth).
    pub lr: f64,
    /// Seed of the conversations drawn.
    pub seed: u64,
    /// Steps between progress reports (each scores held-out conversations).
    pub report_every: usize,
    /// The tools the agent will offer (`agent.tools`): every prompt carries
    /// them as the model's template renders them, as in the agent's
    /// episodes, and the searches use the search tools among them.
    pub tools: Vec<String>,
}

/// What pre-training reached.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyReport {
    /// The last step's loss (per trainable token).
    pub loss: f64,
    /// The loss (per reply token) on the held-out conversations scored.
    pub held_out_loss: f64,
    /// The same before training.
    pub held_out_loss_at_start: f64,
    /// Per task: held-out conversations (documents never trained on) whose
    /// reply greedy decoding gives exactly, out of [`SCORED`].
    pub exact: Vec<(Task, usize)>,
    /// Seconds spent.
    pub seconds: f64,
}

impl std::fmt::Display for CopyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "loss {:.3}, held-out loss {:.3} (at start {:.3}), exact",
            self.loss, self.held_out_loss, self.held_out_loss_at_start
        )?;
        for (task, exact) in &self.exact {
            write!(f, " {} {exact}/{SCORED}", task.name())?;
        }
        write!(f, " ({:.0} s)", self.seconds)
    }
}

/// The documents of the BEIR collection at `dir` and the questions judged in
/// its `split`: what copy pre-training and copy rehearsal draw from.
pub fn documents_and_questions(dir: &Path, split: &str) -> Result<(Vec<Document>, Vec<String>), BeirError> {
    let beir = BeirDir::new(dir);
    let documents = beir.corpus(BadLines::Fail)?.collect::<Result<Vec<_>, _>>()?;
    let asked = beir.qrels(split)?;
    let questions =
        beir.queries(BadLines::Fail)?.into_iter().filter(|q| asked.contains_key(&q.id)).map(|q| q.text).collect();
    Ok((documents, questions))
}

/// Pre-trains the model in `model_dir` (an HF directory, tokenizer included)
/// on `documents` and writes the result to `out` (see the module docs).
/// One document in ten is held out to score copying of unseen text.
pub fn copy_pretrain(
    model_dir: &Path,
    documents: &[Document],
    questions: &[String],
    spec: &CopyTraining,
    out: &Path,
) -> Result<CopyReport, Error> {
    let held_out = |key: &str| sleuth_kit::seed::derive(spec.seed, key).is_multiple_of(10);
    let tools = Offered::new(&spec.tools)?;
    let split = |held: bool| {
        Source::new(
            documents.iter().filter(|d| held_out(&d.id) == held).cloned().collect(),
            questions.iter().filter(|q| held_out(q) == held).cloned().collect(),
            tools.clone(),
        )
    };
    let (trained, scored) = (split(false), split(true));
    if trained.documents() < 2 || scored.documents() < 2 {
        return Err(Error::InvalidArgument(format!(
            "copy pre-training needs a collection of at least a few dozen documents, not {}",
            documents.len()
        )));
    }
    if spec.batch == 0 || spec.report_every == 0 {
        return Err(Error::InvalidArgument("copy pre-training: batch and report_every must be positive".into()));
    }
    let renderer = ReplyRenderer::from_dir(model_dir)?;
    let peak = AdamW { lr: spec.lr, weight_decay: 0.01, ..AdamW::default() };
    let mut trainer = sft_trainer(model_dir, peak, MICRO_BATCH)?;
    let started = Instant::now();
    let mut draw = Draw::new(spec.seed);
    let mut loss = f64::NAN;
    let (exact, held_out_loss_at_start) = score(&trainer, &renderer, &scored, spec.seed)?;
    let mut report =
        CopyReport { loss, held_out_loss: held_out_loss_at_start, held_out_loss_at_start, exact, seconds: 0.0 };
    for step in 0..spec.steps {
        trainer.config.optimizer.lr = spec.lr * LrSchedule::Cosine.scale(step as u64, spec.steps as u64);
        let mut samples = (0..spec.batch)
            .map(|i| {
                if i % 2 == 0 {
                    return repeated(&trained, &renderer, &mut draw);
                }
                conversation_sample(&trained, &renderer, (step * spec.batch + i) / 2, &mut draw, Teach::Reply)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Micro-batches of like lengths pad little (conversations run from
        // tens to hundreds of tokens); the loss is over the whole step, so
        // the order changes nothing else.
        samples.sort_by_key(|sample| sample.tokens.len());
        loss = trainer.step(&samples)?.loss;
        if (step + 1) % spec.report_every == 0 || step + 1 == spec.steps {
            let (exact, held_out_loss) = score(&trainer, &renderer, &scored, spec.seed)?;
            report = CopyReport {
                loss,
                held_out_loss,
                held_out_loss_at_start,
                exact,
                seconds: started.elapsed().as_secs_f64(),
            };
            eprintln!("copy pre-training: step {}/{}: {report}", step + 1, spec.steps);
        }
    }
    save_trained(&trainer, model_dir, out)?;
    Ok(report)
}

/// Per task, how many of [`SCORED`] conversations over `documents` (the
/// same ones at every report) greedy decoding answers exactly; and the loss
/// per reply token over all of them.
fn score(
    trainer: &Trainer,
    renderer: &ReplyRenderer,
    source: &Source,
    seed: u64,
) -> Result<(Vec<(Task, usize)>, f64), Error> {
    let mut draw = Draw::new(seed ^ 0x5c0e);
    let (mut logprob, mut tokens) = (0.0, 0usize);
    let mut exact = Vec::new();
    for task in Task::ALL {
        let mut right = 0;
        for _ in 0..SCORED {
            let (messages, reply) = conversation(source, task, &mut draw);
            let made = renderer.sample(&messages, &source.tools.schemas, &reply)?;
            let (predicted, reply_logprob) = predict_reply(&trainer.model, &made.prompt, &made.reply)?;
            right += usize::from(predicted == made.reply);
            logprob += reply_logprob;
            tokens += made.reply.len();
        }
        exact.push((task, right));
    }
    Ok((exact, -logprob / tokens as f64))
}
