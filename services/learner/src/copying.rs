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
//! - bridge: after a search, the next search is the first name in the
//!   results that no earlier query holds (the teacher's bridge rule), or a
//!   submission (without ids: the agent ranks what the searches found)
//!   when there is none.
//!
//! Conversations open with the agent's system prompt (`sleuth_chat`) and the
//! tools the agent will offer (`--tools`), as the model's own template
//! renders them (a fresh policy's names them in one line): the context the
//! policy copies in during its episodes. A bridge's first search is the
//! question's, as the agent's `opening_search` shows it. Which task an episode
//! needs, and when, is left to SFT and RL.

use std::path::Path;
use std::time::Instant;

use serde_json::{Value as Json, json};
use sleuth_beir::Document;
use sleuth_chat::observation::{Hit, SEARCH_HITS, bridge_query, parse_search_results, search_results, shorten};
use sleuth_chat::tool_calls_text;
use sleuth_chat::tools::{READ_DOCUMENT, SEARCH_TOOLS, SUBMIT_RANKING, ToolSchema};

use crate::Error;
use crate::batch::Sample;
use crate::reply::{ReplyRenderer, predict_reply, save_trained, sft_trainer};
use crate::shard::AdamW;
use crate::trainer::Trainer;

/// Characters of a sentence used as a user message or query.
const SENTENCE_CHARS: usize = 160;
/// Words in a repeated string, and the most tokens of it kept.
const REPEAT_WORDS: usize = 120;
const REPEAT_TOKENS: usize = 200;
/// The most words in a random question.
const RANDOM_WORDS: usize = 30;
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

/// One of the skills taught.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    Ask,
    Bridge,
}

impl Task {
    const ALL: [Task; 2] = [Task::Ask, Task::Bridge];
    /// The conversations of a step, in turn: bridges twice as often, the
    /// harder skill (find the name, then copy it from a long observation)
    /// and the only one an episode opened by the agent's search needs.
    const MIX: [Task; 3] = [Task::Ask, Task::Bridge, Task::Bridge];

    fn name(self) -> &'static str {
        match self {
            Task::Ask => "ask",
            Task::Bridge => "bridge",
        }
    }
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

/// Draws from a seed (counter-based, so a run is reproducible).
struct Draw {
    seed: u64,
    drawn: u64,
}

impl Draw {
    fn below(&mut self, n: usize) -> usize {
        self.drawn += 1;
        (sleuth_kit::seed::derive(self.seed, &self.drawn.to_string()) % n as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// What conversations are drawn from.
struct Source<'a> {
    documents: Vec<&'a Document>,
    /// Training questions (may be none).
    questions: Vec<&'a str>,
    /// The documents' distinct words.
    words: Vec<&'a str>,
    /// The offered tools, as the chat template renders them.
    tools: &'a Offered,
}

impl<'a> Source<'a> {
    fn new(documents: Vec<&'a Document>, questions: Vec<&'a str>, tools: &'a Offered) -> Self {
        let mut words: Vec<&str> = documents.iter().flat_map(|d| d.text.split_whitespace()).collect();
        words.sort_unstable();
        words.dedup();
        Self { documents, questions, words, tools }
    }
}

/// The tools of the agent's episodes, in the order it offers them.
struct Offered {
    /// The search tools among them.
    searches: Vec<&'static str>,
    /// Every schema (the answer tool last), as OpenAI `tools` entries.
    schemas: Vec<Json>,
}

impl Offered {
    /// `names` in the tool gateway's order, then the answer tool; an error
    /// names a tool that is not the agent's, or a list without a search.
    fn new(names: &[String]) -> Result<Self, Error> {
        if let Some(unknown) = names.iter().find(|n| ToolSchema::named(n).is_none() || *n == SUBMIT_RANKING) {
            return Err(Error::InvalidArgument(format!(
                "--tools names {unknown:?}, not one of {}, {READ_DOCUMENT}",
                SEARCH_TOOLS.join(", ")
            )));
        }
        let offered = |name: &&str| names.iter().any(|n| n == name);
        let searches: Vec<&'static str> = SEARCH_TOOLS.into_iter().filter(offered).collect();
        if searches.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "--tools must name a search tool ({})",
                SEARCH_TOOLS.join(", ")
            )));
        }
        let schemas = SEARCH_TOOLS
            .into_iter()
            .chain([READ_DOCUMENT])
            .filter(offered)
            .chain([SUBMIT_RANKING])
            .filter_map(ToolSchema::named)
            .map(|schema| schema.function())
            .collect();
        Ok(Self { searches, schemas })
    }
}

/// A sentence of a document, cut to [`SENTENCE_CHARS`].
fn sentence(document: &Document, draw: &mut Draw) -> String {
    let sentences: Vec<&str> = document.text.split_inclusive(". ").map(str::trim).filter(|s| !s.is_empty()).collect();
    let chosen = if sentences.is_empty() { document.title.as_str() } else { draw.pick(&sentences) };
    shorten(chosen, SENTENCE_CHARS).trim().to_owned()
}

/// A string of random words twice over, as raw text with the loss on the
/// second copy: every token of it is predictable by copying and by nothing
/// else. This dense supervision is where a tiny model's copying circuit
/// (induction heads) forms; the conversations alone, a few copied words
/// each, did not form it in thousands of steps.
fn repeated(source: &Source, renderer: &ReplyRenderer, draw: &mut Draw) -> Result<Sample, Error> {
    let words = (0..REPEAT_WORDS).map(|_| *draw.pick(&source.words)).collect::<Vec<_>>().join(" ");
    let once = renderer.encode(&words)?;
    let once = &once[..once.len().min(REPEAT_TOKENS)];
    let tokens: Vec<i64> = once.iter().chain(once).copied().collect();
    // The first token of the copy is not predictable; the rest are.
    let mask = (0..tokens.len()).map(|j| if j > once.len() { 1.0 } else { 0.0 }).collect();
    Ok(Sample { behaviour: vec![0.0; tokens.len()], tokens, mask, advantage: 0.0 })
}

fn search(tool: &str, query: &str) -> String {
    tool_calls_text(&[json!({"name": tool, "arguments": {"query": query, "k": SEARCH_HITS}})])
}

/// A conversation teaching `task` from `documents`, and its reply. A bridge
/// with no name to follow is taught as a submission.
fn conversation(source: &Source, task: Task, draw: &mut Draw) -> (Vec<Json>, String) {
    let documents = &source.documents;
    let tool = *draw.pick(&source.tools.searches);
    // A third of the messages are training questions, the text the policy
    // will be asked (the first search copies one; SFT alone learnt to write
    // a remembered name there instead). The rest are strings of words drawn
    // uniformly from the collection's vocabulary, which no n-gram statistics
    // predict, so only copying lowers their loss (long ones copy many tokens
    // per conversation), and document sentences.
    let question = match draw.below(3) {
        0 if !source.questions.is_empty() => (*draw.pick(&source.questions)).to_owned(),
        1 => (0..2 + draw.below(RANDOM_WORDS - 1)).map(|_| *draw.pick(&source.words)).collect::<Vec<_>>().join(" "),
        _ => {
            let document = documents[draw.below(documents.len())];
            sentence(document, draw)
        }
    };
    // The agent's own system prompt: the context the policy will copy in.
    let mut messages = vec![
        json!({"role": "system", "content": sleuth_chat::SYSTEM_PROMPT}),
        json!({"role": "user", "content": question}),
    ];
    if task == Task::Ask {
        return (messages, search(tool, &question));
    }
    let mut queries = vec![question.clone()];
    let mut bridge = None;
    for round in 0..1 + usize::from(draw.chance(35)) {
        let query = match (round, bridge.take()) {
            (0, _) | (_, None) => question.clone(),
            (_, Some(name)) => name,
        };
        let hits: Vec<Hit> = (0..1 + draw.below(SEARCH_HITS))
            .map(|_| {
                let document = *draw.pick(documents);
                Hit { id: &document.id, title: &document.title, text: &document.text }
            })
            .collect();
        let observation = search_results(tool, &query, &hits);
        let listed = parse_search_results(&observation);
        bridge = bridge_query(&listed, &queries);
        messages.push(json!({"role": "assistant", "content": search(tool, &query)}));
        messages.push(json!({"role": "tool", "content": observation}));
        queries.push(query);
    }
    let reply = match bridge {
        Some(name) => search(tool, &name),
        None => tool_calls_text(&[json!({"name": SUBMIT_RANKING, "arguments": {}})]),
    };
    (messages, reply)
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
            documents.iter().filter(|d| held_out(&d.id) == held).collect(),
            questions.iter().map(String::as_str).filter(|q| held_out(q) == held).collect(),
            &tools,
        )
    };
    let (trained, scored) = (split(false), split(true));
    if trained.documents.len() < 2 || scored.documents.len() < 2 {
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
    let mut draw = Draw { seed: spec.seed, drawn: 0 };
    let mut loss = f64::NAN;
    let warmup = (spec.steps / 20).max(1);
    let (exact, held_out_loss_at_start) = score(&trainer, &renderer, &scored, spec.seed)?;
    let mut report =
        CopyReport { loss, held_out_loss: held_out_loss_at_start, held_out_loss_at_start, exact, seconds: 0.0 };
    for step in 0..spec.steps {
        let progress = step.saturating_sub(warmup) as f64 / (spec.steps - warmup).max(1) as f64;
        let scale = if step < warmup {
            (step + 1) as f64 / warmup as f64
        } else {
            0.1 + 0.45 * (1.0 + (std::f64::consts::PI * progress).cos())
        };
        trainer.config.optimizer.lr = spec.lr * scale;
        let mut samples = (0..spec.batch)
            .map(|i| {
                if i % 2 == 0 {
                    return repeated(&trained, &renderer, &mut draw);
                }
                let task = Task::MIX[(step * spec.batch + i) / 2 % Task::MIX.len()];
                let (messages, reply) = conversation(&trained, task, &mut draw);
                renderer.sample(&messages, &tools.schemas, &reply).map(|made| made.sample)
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
    let mut draw = Draw { seed: seed ^ 0x5c0e, drawn: 0 };
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
