//! The agent's tools as the policy reads them: names, descriptions and
//! JSON-schema parameters. The tool gateway offers the collection's tools,
//! the agent adds the answer tool, and a fresh policy's copy pre-training
//! renders the same schemas into its prompts: one definition, so that what a
//! policy is pre-trained on is what its episodes show it.

use serde_json::{Value as Json, json};

use crate::observation::LEADS;

pub const BM25_SEARCH: &str = "bm25_search";
pub const VECTOR_SEARCH: &str = "vector_search";
pub const HYBRID_SEARCH: &str = "hybrid_search";
/// BM25 with RM3 pseudo-relevance feedback: the query expanded with the
/// words that characterise its first hits.
pub const RM3_SEARCH: &str = "rm3_search";
pub const READ_DOCUMENT: &str = "read_document";
/// The agent's tool that searches, with `bm25_search`, one of the leads
/// listed under the latest search's results, by its number
/// (`crate::observation::LEADS`): a policy then chooses a lead with one
/// number instead of copying a name it may not spell.
pub const FOLLOW_LEAD: &str = "follow_lead";
/// The tool the agent answers with a ranking of documents.
pub const SUBMIT_RANKING: &str = "submit_ranking";
/// The tool the agent answers with in words, citing documents.
pub const SUBMIT_ANSWER: &str = "submit_answer";

/// The tools that end an episode with its answer.
pub const ANSWER_TOOLS: [&str; 2] = [SUBMIT_RANKING, SUBMIT_ANSWER];

/// The search tools, in the order a collection lists them.
pub const SEARCH_TOOLS: [&str; 4] = [BM25_SEARCH, RM3_SEARCH, VECTOR_SEARCH, HYBRID_SEARCH];

/// Hits a search call may ask for.
pub const MAX_TOOL_K: u64 = 50;

/// One tool as a policy is told of it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSchema {
    /// What the policy calls it by.
    pub name: &'static str,
    /// What it is for, in the policy's prompt.
    pub description: &'static str,
    /// Its arguments, as a JSON schema.
    pub parameters: Json,
}

impl ToolSchema {
    /// The schema of the tool called `name`, if it is one of the agent's.
    pub fn named(name: &str) -> Option<Self> {
        let (name, description, parameters) = match name {
            BM25_SEARCH => (
                BM25_SEARCH,
                "Keyword search (BM25) over the document collection. Best for exact terms, names, \
                 identifiers and rare words. Returns document ids, titles and snippets.",
                search_parameters(),
            ),
            RM3_SEARCH => (
                RM3_SEARCH,
                "Keyword search (BM25) with the query expanded by the words that characterise its first \
                 hits (RM3 pseudo-relevance feedback), so it also finds documents that share few words \
                 with the query. Returns document ids, titles and snippets.",
                search_parameters(),
            ),
            VECTOR_SEARCH => (
                VECTOR_SEARCH,
                "Semantic search (sentence embeddings) over the document collection. Best for concepts, \
                 paraphrases and questions in natural language. Returns document ids, titles and snippets.",
                search_parameters(),
            ),
            HYBRID_SEARCH => (
                HYBRID_SEARCH,
                "Keyword and semantic search combined (reciprocal rank fusion). A good default when \
                 unsure which kind of search fits. Returns document ids, titles and snippets.",
                search_parameters(),
            ),
            READ_DOCUMENT => (
                READ_DOCUMENT,
                "Read the full text of one document by its id.",
                json!({
                    "type": "object",
                    "properties": {"doc_id": {"type": "string", "description": "Document id from a search result."}},
                    "required": ["doc_id"],
                    "additionalProperties": false
                }),
            ),
            FOLLOW_LEAD => (
                FOLLOW_LEAD,
                "Search for one of the leads listed under the latest search results (names they mention \
                 that the question does not), by its number. Returns document ids, titles and snippets.",
                json!({
                    "type": "object",
                    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": LEADS, "description": "The lead's number."}},
                    "required": ["n"],
                    "additionalProperties": false
                }),
            ),
            // `doc_ids` may be left out (the agent then ranks what the
            // searches found); the schema does not say so yet: the test
            // policies imprinted on this text stop searching when it changes.
            SUBMIT_RANKING => (
                SUBMIT_RANKING,
                "Submit your final answer: the ids of the documents that answer the question, most relevant first. \
                 This ends the search.",
                json!({
                    "type": "object",
                    "properties": {"doc_ids": {"type": "array", "items": {"type": "string"}, "description": "document ids, best first"}},
                    "required": ["doc_ids"]
                }),
            ),
            SUBMIT_ANSWER => (
                SUBMIT_ANSWER,
                "Submit your final answer in words, as short as possible, and the ids of the documents \
                 that support it. This ends the search.",
                json!({
                    "type": "object",
                    "properties": {
                        "answer": {"type": "string", "description": "the answer, a few words"},
                        "citations": {"type": "array", "items": {"type": "string"}, "description": "ids of the documents the answer rests on"}
                    },
                    "required": ["answer", "citations"],
                    "additionalProperties": false
                }),
            ),
            _ => return None,
        };
        Some(Self { name, description, parameters })
    }

    /// The tool as an OpenAI `tools` entry, the form chat templates render.
    pub fn function(&self) -> Json {
        json!({"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}})
    }
}

fn search_parameters() -> Json {
    json!({
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to search for."},
            "k": {"type": "integer", "minimum": 1, "maximum": MAX_TOOL_K, "description": "Number of results (default 10)."}
        },
        "required": ["query"],
        "additionalProperties": false
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_has_a_schema_and_others_none() {
        for name in SEARCH_TOOLS.into_iter().chain([READ_DOCUMENT, FOLLOW_LEAD]).chain(ANSWER_TOOLS) {
            let schema = ToolSchema::named(name).unwrap();
            assert_eq!(schema.function()["function"]["name"], name);
            assert_eq!(schema.parameters["type"], "object");
        }
        assert!(ToolSchema::named("sql").is_none());
    }
}
