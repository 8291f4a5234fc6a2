//! gRPC handlers: thin translations between the proto and the gateway's logic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sleuth_beir::{BadLines, BeirDir};
use sleuth_proto::tools::v1 as pb;
use sleuth_proto::tools::v1::tool_gateway_server::ToolGateway;
use sleuth_store::S3Args;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::bm25::{Bm25Options, Stemming};
use crate::collection::{Collection, Collections, Hit, Method, validate_name};
use crate::embed::batcher::Embedder;
use crate::error::Error;
use crate::index::{self, BuildProgress};
use crate::storage;
use crate::tools::{self, HYBRID_SEARCH, MAX_QUERY_CHARS, RM3_SEARCH, ToolCall};
use crate::vectors::VectorSearch;

/// Largest `k` of the typed Search RPC.
pub const MAX_SEARCH_K: u32 = 1000;

/// The most hits a tool call may rank beyond those it shows
/// (`CallToolRequest.ranking_depth`).
pub const MAX_RANKING_DEPTH: u32 = 100;

/// State shared by the handlers.
#[derive(Clone)]
pub struct Handlers {
    pub collections: Collections,
    /// Where CreateCollection builds indexes and remote indexes are cached.
    pub index_root: PathBuf,
    /// The directories local paths in requests must lie in (the index root among them).
    pub collection_roots: sleuth_store::LocalRoots,
    pub s3: S3Args,
    /// Query embeddings for vector search; None when no embedding model is configured.
    pub embedder: Option<Embedder>,
    /// The tools offered beside BM25 search and document reads.
    pub optional_tools: tools::Optional,
}

/// The refusal of an optional tool this gateway was not asked to offer.
fn not_enabled(tool: &str) -> Status {
    Error::InvalidArgument(format!("unknown tool {tool:?} (not enabled on this gateway; see ListTools)")).into()
}

/// Runs blocking work (searches, index builds, file copies) off the async runtime.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> Result<T, Error> + Send + 'static) -> Result<T, Status> {
    let result = tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|join| Err(Error::Internal(format!("worker thread failed: {join}"))));
    result.map_err(Status::from)
}

fn hits_to_proto(collection: &Collection, hits: &[Hit]) -> Vec<pb::SearchHit> {
    hits.iter()
        .map(|hit| {
            let document = collection.document(hit.ordinal);
            pb::SearchHit {
                doc_id: document.id.clone(),
                title: document.title.clone(),
                snippet: sleuth_chat::observation::snippet(&document.text),
                score: hit.score,
            }
        })
        .collect()
}

fn collection_to_proto(collection: &Collection) -> pb::Collection {
    pb::Collection {
        name: collection.name().to_owned(),
        documents: collection.len() as u64,
        methods: collection
            .methods()
            .iter()
            .map(|method| match method {
                Method::Bm25 => pb::SearchMethod::Bm25 as i32,
                Method::Vector => pb::SearchMethod::Vector as i32,
            })
            .collect(),
        embedding_model: collection.manifest.vectors.as_ref().map(|v| v.model.clone()).unwrap_or_default(),
        embedding_dim: collection.manifest.vectors.as_ref().map_or(0, |v| v.dim),
        index_uri: collection.index_uri.clone(),
    }
}

#[tonic::async_trait]
impl ToolGateway for Handlers {
    async fn list_tools(
        &self,
        request: Request<pb::ListToolsRequest>,
    ) -> Result<Response<pb::ListToolsResponse>, Status> {
        let collection = self.collections.get(&request.into_inner().collection)?;
        let specs = tools::specs(&collection, self.optional_tools);
        let openai_tools_json = tools::openai_tools_json(&specs);
        Ok(Response::new(pb::ListToolsResponse { tools: specs, openai_tools_json }))
    }

    async fn call_tool(&self, request: Request<pb::CallToolRequest>) -> Result<Response<pb::CallToolResponse>, Status> {
        let span = tracing::info_span!(
            "tool_call",
            tool = %request.get_ref().name,
            collection = %request.get_ref().collection,
            episode_id = %request.get_ref().episode_id,
        );
        self.called(request.into_inner()).instrument(span).await
    }
    async fn search(&self, request: Request<pb::SearchRequest>) -> Result<Response<pb::SearchResponse>, Status> {
        let request = request.into_inner();
        let collection = self.collections.get(&request.collection)?;
        if !(1..=MAX_SEARCH_K).contains(&request.k) {
            return Err(
                Error::InvalidArgument(format!("k must be between 1 and {MAX_SEARCH_K}, got {}", request.k)).into()
            );
        }
        let query = request.query.trim();
        if query.is_empty() {
            return Err(Error::InvalidArgument("query must not be empty".to_owned()).into());
        }
        let query = sleuth_chat::observation::shorten(query, MAX_QUERY_CHARS).to_owned();
        let method = pb::SearchMethod::try_from(request.method).unwrap_or(pb::SearchMethod::Unspecified);
        let k = request.k as usize;
        let started = std::time::Instant::now();
        let searched = collection.clone();
        let hits = match method {
            pb::SearchMethod::Bm25 | pb::SearchMethod::Unspecified => {
                blocking(move || searched.bm25(&query, k)).await?
            }
            pb::SearchMethod::Bm25Rm3 => blocking(move || searched.bm25_rm3(&query, k)).await?,
            pb::SearchMethod::Vector => {
                let vector = self.query_vector(&collection, &query).await?;
                blocking(move || searched.vector_search(&vector, k)).await?
            }
            pb::SearchMethod::Hybrid => {
                let vector = self.query_vector(&collection, &query).await?;
                blocking(move || searched.hybrid(&query, &vector, k)).await?
            }
        };
        let took_micros = started.elapsed().as_micros() as u64;
        Ok(Response::new(pb::SearchResponse { hits: hits_to_proto(&collection, &hits), took_micros }))
    }

    async fn get_document(&self, request: Request<pb::GetDocumentRequest>) -> Result<Response<pb::Document>, Status> {
        let request = request.into_inner();
        let collection = self.collections.get(&request.collection)?;
        let document = collection.document_by_id(&request.doc_id).ok_or_else(|| {
            Error::NotFound(format!(
                "no document with doc_id {:?} in collection {:?}",
                request.doc_id, request.collection
            ))
        })?;
        Ok(Response::new(pb::Document {
            doc_id: document.id.clone(),
            title: document.title.clone(),
            text: document.text.clone(),
        }))
    }

    async fn create_collection(
        &self,
        request: Request<pb::CreateCollectionRequest>,
    ) -> Result<Response<BoxStream<pb::IndexProgress>>, Status> {
        let request = request.into_inner();
        validate_name(&request.name)?;
        let bm25 = bm25_options(request.bm25.as_ref())?;
        let vector = request.vector.clone().unwrap_or_default();
        if !vector.model_dir.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "vector.model_dir {:?}: collections are embedded with the gateway's model; leave it empty",
                vector.model_dir
            ))
            .into());
        }
        let encoder = match (&self.embedder, vector.disabled) {
            (_, true) => None,
            (Some(embedder), false) => {
                Some((embedder.encoder.clone(), if vector.exact { VectorSearch::Exact } else { VectorSearch::Hnsw }))
            }
            (None, false) => {
                return Err(Error::InvalidArgument(
                    "vector indexing needs an embedding model (--embedding-model); set vector.disabled for BM25 only"
                        .to_owned(),
                )
                .into());
            }
        };
        let bad_lines = if request.skip_bad_lines { BadLines::Skip } else { BadLines::Fail };
        let out = self.index_root.join(&request.name);
        let source_uri = self.confined(&request.source_uri)?;
        let source = storage::fetch_beir(&source_uri, &self.index_root, &self.s3).await?;
        let collections = self.collections.clone();
        let (sender, receiver) = mpsc::channel(16);
        let name = request.name.clone();
        let index_uri = out.display().to_string();
        tokio::task::spawn_blocking(move || {
            let report = |progress: BuildProgress| {
                let _ = sender.blocking_send(Ok(pb::IndexProgress {
                    phase: progress.phase.to_owned(),
                    done_items: progress.done,
                    total_items: progress.total,
                    skipped_lines: progress.skipped_lines,
                    done: false,
                    collection: None,
                }));
            };
            let mut report = report;
            let result = index::build(
                &BeirDir::new(source.path()),
                &out,
                &name,
                &bm25,
                bad_lines,
                encoder.as_ref().map(|(encoder, search)| (encoder.as_ref(), *search)),
                &mut report,
            )
            .and_then(|manifest| Ok((manifest, Collection::open(&out, index_uri)?)));
            let last = match result {
                Ok((manifest, collection)) => {
                    tracing::info!(collection = %name, documents = manifest.documents, skipped = manifest.skipped_lines, "collection indexed");
                    let collection = collections.insert(collection);
                    Ok(pb::IndexProgress {
                        phase: "done".to_owned(),
                        done_items: manifest.documents,
                        total_items: manifest.documents,
                        skipped_lines: manifest.skipped_lines,
                        done: true,
                        collection: Some(collection_to_proto(&collection)),
                    })
                }
                Err(error) => Err(Status::from(error)),
            };
            let _ = sender.blocking_send(last);
            drop(source);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }

    async fn load_collection(
        &self,
        request: Request<pb::LoadCollectionRequest>,
    ) -> Result<Response<pb::Collection>, Status> {
        let request = request.into_inner();
        validate_name(&request.name)?;
        let index_uri = self.confined(&request.index_uri)?;
        let collection = storage::load(&request.name, &index_uri, &self.index_root, &self.s3).await?;
        let collection = self.collections.insert(collection);
        Ok(Response::new(collection_to_proto(&collection)))
    }

    async fn publish_collection(
        &self,
        request: Request<pb::PublishCollectionRequest>,
    ) -> Result<Response<pb::PublishCollectionResponse>, Status> {
        let request = request.into_inner();
        let collection = self.collections.get(&request.name)?;
        let destination = self.collection_roots.open(&request.destination_uri, &self.s3).map_err(Error::from)?;
        let bytes = storage::publish(&collection.local_dir, &destination).await?;
        Ok(Response::new(pb::PublishCollectionResponse { uri: destination.uri(), bytes }))
    }

    async fn list_collections(
        &self,
        _: Request<pb::ListCollectionsRequest>,
    ) -> Result<Response<pb::ListCollectionsResponse>, Status> {
        let collections = self.collections.list().iter().map(|c| collection_to_proto(c)).collect();
        Ok(Response::new(pb::ListCollectionsResponse { collections }))
    }

    async fn delete_collection(
        &self,
        request: Request<pb::DeleteCollectionRequest>,
    ) -> Result<Response<pb::DeleteCollectionResponse>, Status> {
        self.collections.remove(&request.into_inner().name)?;
        Ok(Response::new(pb::DeleteCollectionResponse {}))
    }
}

impl Handlers {
    /// `uri` as a request may use it: a local path resolved and confined to
    /// the collection roots (refused outside them), an `s3://` one unchanged.
    fn confined(&self, uri: &str) -> Result<String, Error> {
        if uri.trim().is_empty() || uri.starts_with("s3://") {
            return Ok(uri.to_owned());
        }
        let path = Path::new(uri.strip_prefix("file://").unwrap_or(uri));
        let resolved = self.collection_roots.confine(uri, path)?;
        resolved
            .to_str()
            .map(str::to_owned)
            .ok_or_else(|| Error::InvalidArgument(format!("{uri:?} resolves to a path that is not UTF-8")))
    }
}

/// BM25 options of a request, defaults for unset fields.
pub fn bm25_options(options: Option<&pb::Bm25Options>) -> Result<Bm25Options, Error> {
    let defaults = Bm25Options::default();
    let Some(options) = options else { return Ok(defaults) };
    let stemmer = match options.stemmer.as_str() {
        "" | "english" => Stemming::English,
        "none" => Stemming::None,
        other => {
            return Err(Error::InvalidArgument(format!("bm25.stemmer must be \"english\" or \"none\", got {other:?}")));
        }
    };
    let bm25 = Bm25Options {
        k1: options.k1.unwrap_or(defaults.k1),
        b: options.b.unwrap_or(defaults.b),
        stemmer,
        stop_words: options.stop_words.unwrap_or(defaults.stop_words),
    };
    bm25.validate()?;
    Ok(bm25)
}

impl Handlers {
    /// The embedding of a query for vector search on `collection`, through the batcher.
    async fn query_vector(&self, collection: &Collection, query: &str) -> Result<Vec<f32>, Error> {
        let Some(info) = &collection.manifest.vectors else {
            return Err(Error::InvalidArgument(format!(
                "collection {:?} has no vector index (available: bm25_search)",
                collection.name()
            )));
        };
        let Some(embedder) = &self.embedder else {
            return Err(Error::InvalidArgument(
                "this gateway has no embedding model configured (--embedding-model)".to_owned(),
            ));
        };
        if embedder.encoder.name != info.model || embedder.encoder.dim != info.dim as usize {
            return Err(Error::InvalidArgument(format!(
                "collection {:?} was embedded with {} ({} dims) but this gateway runs {} ({} dims)",
                collection.name(),
                info.model,
                info.dim,
                embedder.encoder.name,
                embedder.encoder.dim
            )));
        }
        embedder.embed(query.to_owned()).await
    }

    /// One tool call's observation.
    async fn called(&self, request: pb::CallToolRequest) -> Result<Response<pb::CallToolResponse>, Status> {
        let collection = self.collections.get(&request.collection)?;
        let call = tools::parse_call(&request.name, &request.arguments_json)?;
        let cap = request.observation_char_cap as usize;
        if request.ranking_depth > MAX_RANKING_DEPTH {
            return Err(Error::InvalidArgument(format!(
                "ranking_depth must be at most {MAX_RANKING_DEPTH}, got {}",
                request.ranking_depth
            ))
            .into());
        }
        let depth = request.ranking_depth as usize;
        let vector = match &call {
            ToolCall::Rm3Search { .. } if !self.optional_tools.rm3 => return Err(not_enabled(RM3_SEARCH)),
            ToolCall::HybridSearch { .. } if !self.optional_tools.hybrid => return Err(not_enabled(HYBRID_SEARCH)),
            ToolCall::VectorSearch { query, .. } | ToolCall::HybridSearch { query, .. } => {
                Some(self.query_vector(&collection, query).await?)
            }
            ToolCall::Bm25Search { .. } | ToolCall::Rm3Search { .. } | ToolCall::ReadDocument { .. } => None,
        };
        let searched = collection.clone();
        let with_stats = request.word_stats;
        let (observation, word_df) = blocking(move || {
            let observation = tools::execute(&searched, &call, vector.as_deref(), cap, depth)?;
            let word_df = if with_stats { searched.word_df(&observation.text)? } else { HashMap::new() };
            Ok((observation, word_df))
        })
        .await?;
        Ok(Response::new(pb::CallToolResponse {
            word_df,
            documents: if with_stats { collection.len() as u32 } else { 0 },
            observation: observation.text,
            truncated: observation.truncated,
            hits: hits_to_proto(&collection, &observation.hits),
            hits_shown: observation.shown as u32,
            document: observation.document.map(|ordinal| {
                let document = collection.document(ordinal);
                pb::Document { doc_id: document.id.clone(), title: document.title.clone(), text: document.text.clone() }
            }),
        }))
    }
}
