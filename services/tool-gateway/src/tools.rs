//! The agent-facing tools: their OpenAI function schemas, parsing of the
//! arguments a model generated, and rendering of observations.
//!
//! Everything the model controls arrives here as text. Parsing never panics
//! and every rejection names the argument and what was wrong, because the
//! message is shown to the model as the tool's observation.

use serde_json::{Map, Value, json};
use sleuth_chat::observation;
use sleuth_chat::observation::shorten;
use sleuth_proto::common::v1::ToolSpec;

use crate::collection::{Collection, Hit};
use crate::error::Error;
use crate::index::StoredDocument;

use sleuth_chat::tools::ToolSchema;
pub use sleuth_chat::tools::{BM25_SEARCH, HYBRID_SEARCH, MAX_TOOL_K, READ_DOCUMENT, RM3_SEARCH, VECTOR_SEARCH};

const DEFAULT_TOOL_K: u64 = 10;
/// Queries longer than this are cut (not rejected): models sometimes paste whole documents.
pub const MAX_QUERY_CHARS: usize = 1000;

/// The tools a gateway offers beside BM25 search and document reads, when
/// switched on (so that the tools, and the prompts that list them, of a
/// gateway that has not asked for them stay as they were).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Optional {
    /// `rm3_search` (BM25 with RM3 pseudo-relevance feedback).
    pub rm3: bool,
    /// `hybrid_search` (on collections with embeddings).
    pub hybrid: bool,
}

/// The tools a collection offers, in [`sleuth_chat::tools::SEARCH_TOOLS`]'s
/// order: vector search only where it has embeddings, and the `optional`
/// tools switched on (hybrid search only where it has embeddings).
pub fn specs(collection: &Collection, optional: Optional) -> Vec<ToolSpec> {
    let vectors = collection.methods().contains(&crate::collection::Method::Vector);
    let mut names = vec![BM25_SEARCH];
    if optional.rm3 {
        names.push(RM3_SEARCH);
    }
    if vectors {
        names.push(VECTOR_SEARCH);
        if optional.hybrid {
            names.push(HYBRID_SEARCH);
        }
    }
    names.push(READ_DOCUMENT);
    names
        .into_iter()
        .map(|name| {
            let schema = ToolSchema::named(name).expect("the gateway's tools have schemas");
            ToolSpec {
                name: schema.name.to_owned(),
                description: schema.description.to_owned(),
                parameters_json: schema.parameters.to_string(),
            }
        })
        .collect()
}

/// The specs as an OpenAI `tools` array.
pub fn openai_tools_json(specs: &[ToolSpec]) -> String {
    let tools: Vec<Value> = specs
        .iter()
        .map(|spec| {
            let parameters: Value = serde_json::from_str(&spec.parameters_json).unwrap_or(Value::Null);
            json!({"type": "function", "function": {"name": spec.name, "description": spec.description, "parameters": parameters}})
        })
        .collect();
    Value::Array(tools).to_string()
}

/// A parsed, validated tool call.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolCall {
    Bm25Search { query: String, k: usize },
    Rm3Search { query: String, k: usize },
    VectorSearch { query: String, k: usize },
    HybridSearch { query: String, k: usize },
    ReadDocument { doc_id: String },
}

impl ToolCall {
    /// The tool's name, as published by ListTools.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Bm25Search { .. } => BM25_SEARCH,
            Self::Rm3Search { .. } => RM3_SEARCH,
            Self::VectorSearch { .. } => VECTOR_SEARCH,
            Self::HybridSearch { .. } => HYBRID_SEARCH,
            Self::ReadDocument { .. } => READ_DOCUMENT,
        }
    }
}

/// Parses the arguments a model generated for tool `name`.
pub fn parse_call(name: &str, arguments_json: &str) -> Result<ToolCall, Error> {
    match name {
        BM25_SEARCH | RM3_SEARCH | VECTOR_SEARCH | HYBRID_SEARCH => {
            let mut args = arguments(name, arguments_json, &["query", "k"])?;
            let query = query_argument(name, &mut args)?;
            let k = match args.remove("k") {
                None | Some(Value::Null) => DEFAULT_TOOL_K,
                Some(Value::Number(n)) => match n.as_u64() {
                    Some(k) if (1..=MAX_TOOL_K).contains(&k) => k,
                    _ => return Err(invalid(format!("{name}: k must be an integer from 1 to {MAX_TOOL_K}, got {n}"))),
                },
                Some(other) => {
                    return Err(invalid(format!("{name}: k must be an integer from 1 to {MAX_TOOL_K}, got {other}")));
                }
            };
            let k = k as usize;
            Ok(match name {
                BM25_SEARCH => ToolCall::Bm25Search { query, k },
                RM3_SEARCH => ToolCall::Rm3Search { query, k },
                VECTOR_SEARCH => ToolCall::VectorSearch { query, k },
                _ => ToolCall::HybridSearch { query, k },
            })
        }
        READ_DOCUMENT => {
            let mut args = arguments(name, arguments_json, &["doc_id"])?;
            match args.remove("doc_id") {
                Some(Value::String(id)) if !id.trim().is_empty() => {
                    Ok(ToolCall::ReadDocument { doc_id: id.trim().to_owned() })
                }
                Some(Value::Number(n)) => Ok(ToolCall::ReadDocument { doc_id: n.to_string() }),
                Some(other) => Err(invalid(format!("{name}: doc_id must be a non-empty string, got {other}"))),
                None => Err(invalid(format!("{name}: missing required argument doc_id"))),
            }
        }
        other => Err(invalid(format!(
            "unknown tool {:?} (known: {BM25_SEARCH}, {RM3_SEARCH}, {VECTOR_SEARCH}, {HYBRID_SEARCH}, {READ_DOCUMENT}; ListTools says which a collection offers)",
            shorten(other, 80)
        ))),
    }
}

fn arguments(name: &str, text: &str, allowed: &[&str]) -> Result<Map<String, Value>, Error> {
    let value: Value = serde_json::from_str(text).map_err(|error| {
        invalid(format!("{name}: arguments are not valid JSON ({error}): {:?}", shorten(text, 200)))
    })?;
    let Value::Object(map) = value else {
        return Err(invalid(format!(
            "{name}: arguments must be a JSON object, got {}",
            shorten(&value.to_string(), 200)
        )));
    };
    if let Some(unknown) = map.keys().find(|key| !allowed.contains(&key.as_str())) {
        return Err(invalid(format!(
            "{name}: unknown argument {:?} (expected: {})",
            shorten(unknown, 80),
            allowed.join(", ")
        )));
    }
    Ok(map)
}

fn query_argument(name: &str, args: &mut Map<String, Value>) -> Result<String, Error> {
    match args.remove("query") {
        Some(Value::String(query)) => {
            let query = query.trim();
            if query.is_empty() {
                return Err(invalid(format!("{name}: query must not be empty")));
            }
            Ok(shorten(query, MAX_QUERY_CHARS).to_owned())
        }
        Some(other) => {
            Err(invalid(format!("{name}: query must be a string, got {}", shorten(&other.to_string(), 200))))
        }
        None => Err(invalid(format!("{name}: missing required argument query"))),
    }
}

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

/// The result of a tool call, structured and rendered.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub text: String,
    pub truncated: bool,
    /// Every hit ranked, best first.
    pub hits: Vec<Hit>,
    /// How many of `hits` the text shows.
    pub shown: usize,
    pub document: Option<u32>,
}

/// Runs `call` against `collection` (blocking: searches are CPU work) and
/// renders the observation, capped at `char_cap` characters (0 = no cap).
/// A search ranks `max(k, depth)` hits and shows the first `k` (see
/// `CallToolRequest.ranking_depth`). A vector search needs the query's
/// embedding, computed by the caller.
pub fn execute(
    collection: &Collection,
    call: &ToolCall,
    query_vector: Option<&[f32]>,
    char_cap: usize,
    depth: usize,
) -> Result<Observation, Error> {
    let embedded =
        |what: &str| query_vector.ok_or_else(|| Error::Internal(format!("{what} without a query embedding")));
    let (text, hits, shown, document) = match call {
        ToolCall::Bm25Search { query, k } => {
            shown_hits(collection, BM25_SEARCH, query, *k, collection.bm25(query, depth.max(*k))?)
        }
        ToolCall::Rm3Search { query, k } => {
            shown_hits(collection, RM3_SEARCH, query, *k, collection.bm25_rm3(query, depth.max(*k))?)
        }
        ToolCall::VectorSearch { query, k } => {
            let hits = collection.vector_search(embedded("vector search")?, depth.max(*k))?;
            shown_hits(collection, VECTOR_SEARCH, query, *k, hits)
        }
        ToolCall::HybridSearch { query, k } => {
            let hits = collection.hybrid(query, embedded("hybrid search")?, depth.max(*k))?;
            shown_hits(collection, HYBRID_SEARCH, query, *k, hits)
        }
        ToolCall::ReadDocument { doc_id } => {
            let Some(document) = collection.document_by_id(doc_id) else {
                return Err(Error::NotFound(format!(
                    "{READ_DOCUMENT}: no document with doc_id {:?} in collection {:?}",
                    shorten(doc_id, 80),
                    collection.name()
                )));
            };
            let ordinal = collection.ordinal(doc_id).expect("document was found by id");
            (render_document(document), Vec::new(), 0, Some(ordinal))
        }
    };
    let (text, truncated) = cap(text, char_cap);
    Ok(Observation { text, truncated, hits, shown, document })
}

/// A search's observation parts: the first `k` of `hits` rendered, every
/// hit kept, how many were shown, and no document.
fn shown_hits(
    collection: &Collection,
    tool: &str,
    query: &str,
    k: usize,
    hits: Vec<Hit>,
) -> (String, Vec<Hit>, usize, Option<u32>) {
    let shown = hits.len().min(k);
    (render_hits(collection, tool, query, &hits[..shown]), hits, shown, None)
}

fn render_hits(collection: &Collection, tool: &str, query: &str, hits: &[Hit]) -> String {
    let shown: Vec<observation::Hit> = hits
        .iter()
        .map(|hit| {
            let document = collection.document(hit.ordinal);
            observation::Hit { id: &document.id, title: &document.title, text: &document.text }
        })
        .collect();
    observation::search_results(tool, query, &shown)
}

fn render_document(document: &StoredDocument) -> String {
    format!("doc_id: {}\ntitle: {}\n\n{}", document.id, document.title.trim(), document.text.trim())
}

const TRUNCATION_MARK: &str = "\n[observation truncated]";

/// Cuts `text` to at most `char_cap` characters (marking the cut); 0 = no cap.
fn cap(text: String, char_cap: usize) -> (String, bool) {
    if char_cap == 0 || text.chars().count() <= char_cap {
        return (text, false);
    }
    let mark = TRUNCATION_MARK.chars().count();
    let keep = char_cap.saturating_sub(mark);
    let mut capped = shorten(&text, keep).to_owned();
    if char_cap > mark {
        capped.push_str(TRUNCATION_MARK);
    }
    (capped, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_search_with_default_and_explicit_k() {
        assert_eq!(
            parse_call(BM25_SEARCH, r#"{"query": "  protein folding "}"#).unwrap(),
            ToolCall::Bm25Search { query: "protein folding".into(), k: 10 }
        );
        assert_eq!(
            parse_call(BM25_SEARCH, r#"{"query": "x", "k": 3}"#).unwrap(),
            ToolCall::Bm25Search { query: "x".into(), k: 3 }
        );
    }

    #[test]
    fn each_search_tool_parses_to_its_own_call() {
        let arguments = r#"{"query": "q", "k": 2}"#;
        let (query, k) = ("q".to_owned(), 2);
        assert_eq!(parse_call(RM3_SEARCH, arguments).unwrap(), ToolCall::Rm3Search { query: query.clone(), k });
        assert_eq!(parse_call(VECTOR_SEARCH, arguments).unwrap(), ToolCall::VectorSearch { query: query.clone(), k });
        assert_eq!(parse_call(HYBRID_SEARCH, arguments).unwrap(), ToolCall::HybridSearch { query, k });
    }

    #[test]
    fn rejections_name_the_argument_and_value() {
        let message = |name: &str, args: &str| parse_call(name, args).unwrap_err().to_string();
        assert!(message(BM25_SEARCH, r#"{"query": "x", "k": 0}"#).contains("k must be an integer from 1 to 50, got 0"));
        assert!(message(BM25_SEARCH, r#"{"query": "x", "k": "5"}"#).contains("got \"5\""));
        assert!(message(BM25_SEARCH, r#"{"query": "   "}"#).contains("query must not be empty"));
        assert!(message(BM25_SEARCH, r#"{"q": "x"}"#).contains("unknown argument \"q\""));
        assert!(message(BM25_SEARCH, r#"{"query": "x""#).contains("not valid JSON"));
        assert!(message(BM25_SEARCH, r#"["x"]"#).contains("must be a JSON object"));
        assert!(message("web_search", "{}").contains("unknown tool \"web_search\""));
        assert!(message(READ_DOCUMENT, "{}").contains("missing required argument doc_id"));
    }

    #[test]
    fn enormous_queries_are_capped_not_rejected() {
        let long = "word ".repeat(5000);
        let ToolCall::Bm25Search { query, .. } = parse_call(BM25_SEARCH, &json!({"query": long}).to_string()).unwrap()
        else {
            panic!("expected a search");
        };
        assert_eq!(query.chars().count(), MAX_QUERY_CHARS);
    }

    #[test]
    fn cap_cuts_at_character_boundaries_and_marks_the_cut() {
        let (text, truncated) = cap("é".repeat(100), 50);
        assert!(truncated);
        assert!(text.chars().count() <= 50 && text.ends_with("[observation truncated]"), "{text}");
        assert_eq!(cap("short".to_owned(), 50), ("short".to_owned(), false));
        assert_eq!(cap("x".repeat(10_000), 0).0.len(), 10_000);
    }

    proptest::proptest! {
        #[test]
        fn parsing_never_panics_on_arbitrary_text(name in "\\PC{0,20}", args in "\\PC{0,200}") {
            let _ = parse_call(&name, &args);
            let _ = parse_call(BM25_SEARCH, &args);
            let _ = parse_call(VECTOR_SEARCH, &args);
            let _ = parse_call(READ_DOCUMENT, &args);
        }

        #[test]
        fn parsing_never_panics_on_arbitrary_json(value in arbitrary_json()) {
            let text = value.to_string();
            let _ = parse_call(BM25_SEARCH, &text);
            let _ = parse_call(READ_DOCUMENT, &text);
        }
    }

    fn arbitrary_json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
            "\\PC{0,40}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map(
                    prop_oneof![Just("query".to_owned()), Just("k".to_owned()), Just("doc_id".to_owned()), "\\PC{0,8}"],
                    inner,
                    0..4
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }
}
