//! `learner init-policy`: a fresh policy for one collection. A byte-level
//! BPE tokenizer is trained on the collection's own documents and training
//! questions, and a randomly initialised Llama-style model uses it; both are
//! written as an HF directory that the policy server, the learner and
//! `transformers` load.
//!
//! This is the policy a two-core machine can train (issue 13's demo):
//! - A few million parameters instead of SmolLM2's 135 million.
//! - A vocabulary of hundreds of tokens instead of 49,152. The output layer
//!   dominates a tiny model's cost, and every token of a small vocabulary is
//!   seen often enough to be learnt. That includes the pieces that made-up
//!   names are spelt with, which the policy must copy from search results
//!   into its next query.
//! - It starts knowing nothing of the task, so what it learns is the
//!   recipe's doing: teacher SFT, then GRPO. `--copy-steps` first teaches it
//!   one skill from the documents alone, copying text into tool calls (see
//!   [`crate::copying`]).

use std::path::{Path, PathBuf};

use serde_json::json;
use sleuth_beir::Document;
use sleuth_chat::tool_calls::{CLOSE, OPEN};
use sleuth_chat::tools::{
    BM25_SEARCH, FOLLOW_LEAD, HYBRID_SEARCH, READ_DOCUMENT, RM3_SEARCH, SUBMIT_ANSWER, SUBMIT_RANKING, VECTOR_SEARCH,
};
use sleuth_model::export::{TinyShape, llama_config, write_random};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::ModelWrapper;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder, TokenizerImpl};

use crate::Error;
use crate::copying::{CopyReport, CopyTraining, copy_pretrain, documents_and_questions};

/// The chat template's control tokens (ChatML, as SmolLM2 and Qwen use).
const END_OF_TEXT: &str = "<|endoftext|>";
const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";

/// ChatML, with the offered tools named in the system prompt
/// (`Tools: bm25_search, submit_ranking.`). A template that reads `tools`
/// renders them itself, so their JSON schemas (hundreds of tokens, which
/// `sleuth-chat` writes for templates that know no tools) stay out of every
/// prompt: a policy this small learns its tools' use in copy pre-training
/// and SFT, not from schemas, and a long fixed prefix made copying from the
/// conversation measurably worse (docs/experiments/learner-recipe.md). Tool calls are written
/// into the assistant's content by `sleuth-chat`.
const CHAT_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
{{ '<|im_start|>system\nYou are a search agent.' }}{{ TOOLS }}{{ '<|im_end|>\n' }}{% endif %}\
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}{% if loop.first and message['role'] == 'system' %}{{ TOOLS }}{% endif %}\
{{ '<|im_end|>' + '\n' }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The tools line of [`CHAT_TEMPLATE`], spliced in where it says `{{ TOOLS }}`.
const TOOLS_LINE: &str = "{% if tools %}{{ '\nTools: ' }}{% for tool in tools %}{% if not loop.first %}{{ ', ' }}{% endif %}\
{% if tool.function is defined %}{{ tool.function.name }}{% else %}{{ tool.name }}{% endif %}{% endfor %}{{ '.' }}{% endif %}";

/// Text the policy reads and writes besides the collection's (tool calls and
/// observations), so their punctuation and keywords are merged into tokens
/// too.
const PROTOCOL: &str = "You are a search agent. You can call the following tools. To call tools, reply with only \
<tool_call>[{\"name\": \"bm25_search\", \"arguments\": {\"query\": \"the question\", \"k\": 5}}]</tool_call>\n\
<tool_call>[{\"name\": \"vector_search\", \"arguments\": {\"query\": \"the question\", \"k\": 5}}]</tool_call>\n\
<tool_call>[{\"name\": \"submit_ranking\", \"arguments\": {\"doc_ids\": [\"d1\", \"d2\"]}}]</tool_call>\n\
<tool_call>[{\"name\": \"submit_ranking\", \"arguments\": {}}]</tool_call>\n\
bm25_search results for \"the question\":\n[1] doc_id: d1 | Title\nText.\n[2] doc_id: d2 | Title\nText.\n";

/// Width of an attention head. Narrow heads and no key/value sharing: a
/// copying circuit needs separate heads (one attends to the previous token,
/// another to where the current token occurred before), and a 128-wide
/// policy with 64-wide heads had two query heads sharing one key/value head.
const HEAD_DIM: i64 = 32;

/// What `learner init-policy` makes.
#[derive(clap::Args, Debug)]
pub struct FreshArgs {
    /// The BEIR collection whose documents and training questions the tokenizer is trained on.
    #[arg(long)]
    pub collection: PathBuf,
    /// The split whose questions join the tokenizer's text (never held-out ones).
    #[arg(long, default_value = "train")]
    pub split: String,
    /// The directory to write (must not exist).
    pub out: PathBuf,
    /// Tokens in the vocabulary, the byte alphabet and control tokens included.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(300..))]
    pub vocab_size: u32,
    /// Width of the model (a multiple of 32: one attention head per 32).
    #[arg(long, default_value_t = 256)]
    pub hidden_size: i64,
    /// Transformer layers.
    #[arg(long, default_value_t = 4)]
    pub layers: i64,
    /// Seed of the weights and of the copy pre-training's conversations.
    #[arg(long, default_value_t = 1)]
    pub seed: i64,
    /// Steps of copy pre-training on the collection's documents (0: none;
    /// a policy without it memorises instead of copying, see `copying`).
    #[arg(long, default_value_t = 0)]
    pub copy_steps: usize,
    /// Samples per copy pre-training step (half repeated strings, half conversations).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub copy_batch: u32,
    /// Peak learning rate of copy pre-training.
    #[arg(long, default_value_t = 2e-3)]
    pub copy_lr: f64,
    /// The tools the agent will offer the policy (`agent.tools`), whose
    /// schemas copy pre-training shows in every prompt as the agent does;
    /// its searches use the search tools among them.
    #[arg(long, value_delimiter = ',', default_value = "bm25_search")]
    pub tools: Vec<String>,
}

/// What was made, for the caller to report.
#[derive(Debug)]
pub struct Fresh {
    /// Where the model is.
    pub dir: PathBuf,
    /// Tokens in its vocabulary.
    pub vocab_size: usize,
    /// Parameters of the model.
    pub parameters: i64,
    /// What copy pre-training reached, when it ran.
    pub copying: Option<CopyReport>,
}

/// Trains the tokenizer and writes the model (see the module docs).
pub fn init_policy(args: &FreshArgs) -> Result<Fresh, Error> {
    let invalid = |message: String| Error::InvalidArgument(message);
    if args.out.exists() {
        return Err(invalid(format!("{} exists; init-policy writes a new directory", args.out.display())));
    }
    if args.hidden_size < HEAD_DIM || args.hidden_size % HEAD_DIM != 0 {
        return Err(invalid(format!("--hidden-size {} must be a positive multiple of {HEAD_DIM}", args.hidden_size)));
    }
    if args.layers < 1 {
        return Err(invalid(format!("--layers {} must be at least 1", args.layers)));
    }
    if !(args.copy_lr > 0.0 && args.copy_lr.is_finite()) {
        return Err(invalid(format!("--copy-lr {} must be a positive number", args.copy_lr)));
    }
    let (documents, questions, texts) = collection_text(&args.collection, &args.split)?;
    let tokenizer = train_tokenizer(&texts, args.vocab_size as usize, &args.tools)?;
    let scratch = tempfile::tempdir().map_err(|e| Error::Train(e.to_string()))?;
    write_tokenizer_files(&tokenizer, scratch.path())?;
    let id = |token: &str| tokenizer.token_to_id(token);
    let heads = args.hidden_size / HEAD_DIM;
    let shape = TinyShape {
        hidden_size: args.hidden_size,
        layers: args.layers,
        heads,
        kv_heads: heads,
        intermediate_size: 3 * args.hidden_size,
    };
    let config = llama_config(shape, tokenizer.get_vocab_size(true), [id(IM_START), id(IM_END), id(IM_END)]);
    let copying = if args.copy_steps == 0 {
        write_random(&config, scratch.path(), &args.out, args.seed)?;
        None
    } else {
        let random = scratch.path().join("random");
        write_random(&config, scratch.path(), &random, args.seed)?;
        let spec = CopyTraining {
            steps: args.copy_steps,
            batch: args.copy_batch as usize,
            lr: args.copy_lr,
            seed: args.seed as u64,
            report_every: 25,
            tools: args.tools.clone(),
        };
        Some(copy_pretrain(&random, &documents, &questions, &spec, &args.out)?)
    };
    let parameters = parameter_count(&args.out)?;
    Ok(Fresh { dir: args.out.clone(), vocab_size: tokenizer.get_vocab_size(true), parameters, copying })
}

/// The documents, the questions of `split`, and the text the tokenizer
/// learns from: the documents (title and text), those questions, the agent's
/// system prompt and the protocol's text.
type CollectionText = (Vec<Document>, Vec<String>, Vec<String>);

fn collection_text(collection: &Path, split: &str) -> Result<CollectionText, Error> {
    let (documents, questions) = documents_and_questions(collection, split)
        .map_err(|e| Error::InvalidArgument(format!("--collection {}: {e}", collection.display())))?;
    let mut texts = vec![sleuth_chat::SYSTEM_PROMPT.to_owned()];
    texts.extend(documents.iter().map(|d| format!("{} | {}\n{}", d.id, d.title, d.text)));
    // The protocol once per document: every reply and observation spells it,
    // so its words are as frequent as the collection's commonest, and BPE
    // merges them ("arguments", "query") instead of leaving them in letters.
    texts.extend(std::iter::repeat_n(PROTOCOL.to_owned(), documents.len()));
    texts.extend(questions.iter().cloned());
    Ok((documents, questions, texts))
}

/// A byte-level BPE of `vocab_size` tokens over `texts`: lossless on any
/// text (every byte is a token), with the chat template's control tokens
/// and the protocol's words, among them the names of the offered `tools`.
fn train_tokenizer(texts: &[String], vocab_size: usize, tools: &[String]) -> Result<Tokenizer, Error> {
    let failed = |e: tokenizers::Error| Error::Train(format!("training the tokenizer: {e}"));
    let byte_level = ByteLevel::new(false, true, true);
    let mut tokenizer: TokenizerImpl<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(BPE::default().into())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(byte_level.into()))
        .with_post_processor(None)
        .with_decoder(Some(byte_level.into()))
        .build()
        .map_err(failed)?;
    let special: Vec<AddedToken> = [END_OF_TEXT, IM_START, IM_END].iter().map(|t| AddedToken::from(*t, true)).collect();
    // Whole tokens (not special: decoding keeps them) for the tool-call tags
    // and the tool names: the choice of a tool is then one token. Spelt in
    // letters (`s ub m it _ ran k ing`, `b m 25 _ s e arch`), the name was
    // a run of choices, and GRPO mixed them (measured: `submit_search`,
    // an unknown tool, after three steps).
    // Tools that came later are tokens only for a policy offered them, so
    // the vocabulary of a policy without them stays as it was.
    let offered = |name: &&str| tools.iter().any(|t| t == name);
    let protocol: Vec<AddedToken> = [OPEN, CLOSE]
        .into_iter()
        .chain([BM25_SEARCH, VECTOR_SEARCH, HYBRID_SEARCH, READ_DOCUMENT, SUBMIT_RANKING])
        .chain([SUBMIT_ANSWER, RM3_SEARCH, FOLLOW_LEAD].into_iter().filter(offered))
        .map(|t| AddedToken::from(t, false))
        .collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size.saturating_sub(protocol.len()))
        .show_progress(false)
        .special_tokens(special)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer.train(&mut trainer, texts.iter()).map_err(failed)?;
    tokenizer.add_tokens(protocol).map_err(failed)?;
    Ok(Tokenizer::from(tokenizer))
}

/// tokenizer.json, tokenizer_config.json, chat_template.jinja and
/// generation_config.json, as an HF model directory has them.
fn write_tokenizer_files(tokenizer: &Tokenizer, dir: &Path) -> Result<(), Error> {
    let failed = |e: String| Error::Train(format!("writing the tokenizer to {}: {e}", dir.display()));
    tokenizer.save(dir.join("tokenizer.json"), false).map_err(|e| failed(e.to_string()))?;
    let id = |token: &str| tokenizer.token_to_id(token);
    let files = [
        (
            "tokenizer_config.json",
            json!({"bos_token": IM_START, "eos_token": IM_END, "pad_token": IM_END, "unk_token": END_OF_TEXT,
                   "model_max_length": 8192, "tokenizer_class": "PreTrainedTokenizerFast"})
            .to_string(),
        ),
        ("chat_template.jinja", CHAT_TEMPLATE.replace("{{ TOOLS }}", TOOLS_LINE)),
        (
            "generation_config.json",
            json!({"bos_token_id": id(IM_START), "eos_token_id": id(IM_END), "pad_token_id": id(IM_END)}).to_string(),
        ),
    ];
    for (name, text) in files {
        std::fs::write(dir.join(name), text).map_err(|e| failed(e.to_string()))?;
    }
    Ok(())
}

fn parameter_count(dir: &Path) -> Result<i64, Error> {
    let tensors =
        tch::Tensor::read_safetensors(dir.join("model.safetensors")).map_err(sleuth_model::ModelError::from)?;
    Ok(tensors.iter().map(|(_, t)| t.numel() as i64).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_tool_is_one_token_only_for_a_policy_offered_it() {
        let texts = vec![PROTOCOL.to_owned(); 4];
        let tokens = |tools: &[&str], text: &str| {
            let tools: Vec<String> = tools.iter().map(|t| (*t).to_owned()).collect();
            let tokenizer = train_tokenizer(&texts, 400, &tools).unwrap();
            tokenizer.encode(text, false).unwrap().get_ids().len()
        };
        assert_eq!(tokens(&["bm25_search"], BM25_SEARCH), 1);
        assert!(tokens(&["bm25_search"], RM3_SEARCH) > 1, "a policy not offered rm3_search keeps its vocabulary");
        assert_eq!(tokens(&["bm25_search", "rm3_search"], RM3_SEARCH), 1);
        assert_eq!(tokens(&["bm25_search", "follow_lead"], FOLLOW_LEAD), 1);
    }
}
