//! The real tool gateway on an ephemeral port, serving real collections.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sleuth_kit::client::{MeshChannel, connect};
use sleuth_kit::{ServeArgs, TelemetryArgs};
use sleuth_proto::tools::v1 as pb;
use sleuth_proto::tools::v1::tool_gateway_client::ToolGatewayClient;
use sleuth_store::S3Args;
use tokio::net::TcpListener;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

struct Gateway {
    addr: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _root: tempfile::TempDir,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn start(collections: Vec<(String, String)>, s3: S3Args) -> Result<Gateway> {
    start_with(collections, s3, |_| {}).await
}

/// [`start`] with the configuration adjusted by `adjust`.
async fn start_with(
    collections: Vec<(String, String)>,
    s3: S3Args,
    adjust: impl FnOnce(&mut tool_gateway::Config),
) -> Result<Gateway> {
    let root = tempfile::tempdir()?;
    let mut config = tool_gateway::Config {
        listen: "127.0.0.1:0".parse()?,
        index_root: root.path().join("indexes"),
        collection_roots: Vec::new(),
        collections,
        embedding_model: None,
        device: "cpu".parse()?,
        embed_max_batch: 32,
        embed_max_wait: Duration::from_millis(2),
        hybrid_tool: true,
        rm3_tool: true,
        s3,
        admin: sleuth_kit::AdminTokenArgs::default(),
        serve: ServeArgs { insecure: true, ..ServeArgs::default() },
        telemetry: TelemetryArgs::default(),
    };
    adjust(&mut config);
    let listener = TcpListener::bind(config.listen).await?;
    let addr = listener.local_addr()?.to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(tool_gateway::run(config, listener, async {
        let _ = stopped.await;
    }));
    let gateway = Gateway { addr, stop: Some(stop), _root: root };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let channel = connect(&gateway.addr, None, Duration::from_secs(5)).await?;
        let request = HealthCheckRequest { service: "sleuth.tools.v1.ToolGateway".into() };
        if HealthClient::new(channel).check(request).await?.into_inner().status() == ServingStatus::Serving {
            return Ok(gateway);
        }
        anyhow::ensure!(Instant::now() < deadline, "gateway never became SERVING");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn client(gateway: &Gateway) -> Result<ToolGatewayClient<MeshChannel>> {
    client_with(gateway, None).await
}

async fn client_with(gateway: &Gateway, token: Option<&str>) -> Result<ToolGatewayClient<MeshChannel>> {
    let token: Option<sleuth_kit::BearerToken> = token.map(str::parse).transpose()?;
    Ok(ToolGatewayClient::new(connect(&gateway.addr, token.as_ref(), Duration::from_secs(5)).await?))
}

/// SciFact indexed for BM25 into a temporary directory (seconds).
fn scifact_index(dir: &std::path::Path) -> Result<String> {
    let source = sleuth_testkit::beir_collection("scifact")?;
    let out = dir.join("scifact-index");
    let bm25 = tool_gateway::bm25::Bm25Options::default();
    let beir = sleuth_beir::BeirDir::new(&source);
    tool_gateway::index::build(&beir, &out, "scifact", &bm25, sleuth_beir::BadLines::Fail, None, &mut |_| {})?;
    Ok(out.display().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_tools_over_scifact_with_clear_errors_and_under_concurrency() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let index = scifact_index(scratch.path())?;
    let gateway = start(vec![("scifact".into(), index)], S3Args::default()).await?;
    let mut tools = client(&gateway).await?;

    let listed = tools.list_tools(pb::ListToolsRequest { collection: "scifact".into() }).await?.into_inner();
    let names: Vec<&str> = listed.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["bm25_search", "rm3_search", "read_document"]);
    let openai: serde_json::Value = serde_json::from_str(&listed.openai_tools_json)?;
    assert_eq!(openai[0]["type"], "function");
    assert_eq!(openai[0]["function"]["parameters"]["required"][0], "query");

    let call = |name: &str, args: &str, cap: u32| pb::CallToolRequest {
        collection: "scifact".into(),
        name: name.into(),
        arguments_json: args.into(),
        observation_char_cap: cap,
        episode_id: "ep-1".into(),
        ranking_depth: 0,
        word_stats: false,
    };
    let found = tools
        .call_tool(call(
            "bm25_search",
            r#"{"query": "microstructural development of human newborn cerebral white matter", "k": 5}"#,
            1200,
        ))
        .await?
        .into_inner();
    assert_eq!(found.hits.len(), 5);
    assert_eq!(found.hits[0].doc_id, "4983", "the SciFact document with exactly this title ranks first");
    assert!(found.observation.contains("doc_id: 4983") && found.observation.chars().count() <= 1200);
    assert_eq!(found.hits_shown, 5);
    // Ranked to a depth of 10 (a submission without ids keeps it), shown to the k of 5.
    let deep = pb::CallToolRequest {
        ranking_depth: 10,
        ..call(
            "bm25_search",
            r#"{"query": "microstructural development of human newborn cerebral white matter", "k": 5}"#,
            0,
        )
    };
    let deep = tools.call_tool(deep).await?.into_inner();
    assert_eq!((deep.hits.len(), deep.hits_shown), (10, 5));
    assert_eq!(deep.hits[..5], found.hits[..], "the same five first");
    assert_eq!(deep.observation.matches("doc_id: ").count(), 5, "only the k asked for are shown");
    assert!(deep.word_df.is_empty() && deep.documents == 0, "statistics only when asked for");
    // A teacher asks how many documents hold each word shown.
    let stats = pb::CallToolRequest { word_stats: true, ..call("bm25_search", r#"{"query": "white matter"}"#, 0) };
    let stats = tools.call_tool(stats).await?.into_inner();
    let shown = sleuth_chat::bridge::words(&stats.observation).len();
    assert!(stats.word_df.len() > 10 && stats.word_df.len() <= shown, "{} of {shown}", stats.word_df.len());
    assert!(!stats.word_df.contains_key("the"), "stop words carry no statistics");
    assert!(stats.word_df["white"] < stats.word_df["results"], "{:?}", stats.word_df);
    assert!(stats.word_df.values().all(|&df| df <= stats.documents) && stats.documents == 5183);
    // RM3 expands the query from its first ten hits: other documents, the best kept near the top.
    let search = |method: pb::SearchMethod| pb::SearchRequest {
        collection: "scifact".into(),
        query: "microstructural development of human newborn cerebral white matter".into(),
        k: 10,
        method: method as i32,
    };
    let ids = |hits: &[pb::SearchHit]| hits.iter().map(|h| h.doc_id.clone()).collect::<Vec<_>>();
    let plain = tools.search(search(pb::SearchMethod::Bm25)).await?.into_inner();
    let expanded = tools.search(search(pb::SearchMethod::Bm25Rm3)).await?.into_inner();
    assert_eq!(expanded.hits.len(), 10);
    assert!(expanded.hits[..3].iter().any(|h| h.doc_id == "4983"), "{:?}", expanded.hits);
    assert_ne!(ids(&plain.hits), ids(&expanded.hits), "the expansion changes the ranking");
    // The model's rm3_search call runs the same expansion.
    let rm3_call = pb::CallToolRequest {
        ranking_depth: 10,
        ..call("rm3_search", r#"{"query": "microstructural development of human newborn cerebral white matter"}"#, 0)
    };
    let rm3_called = tools.call_tool(rm3_call).await?.into_inner();
    assert_eq!(ids(&rm3_called.hits), ids(&expanded.hits));
    assert!(rm3_called.observation.starts_with("rm3_search results"), "{}", rm3_called.observation);
    let too_deep = pb::CallToolRequest { ranking_depth: 101, ..call("bm25_search", r#"{"query": "x"}"#, 0) };
    let status = tools.call_tool(too_deep).await.unwrap_err();
    assert!(status.message().contains("ranking_depth must be at most 100, got 101"), "{status:?}");
    let read = tools.call_tool(call("read_document", r#"{"doc_id": "4983"}"#, 0)).await?.into_inner();
    assert!(read.document.context("read_document returns the document")?.text.len() > 500);
    let capped = tools.call_tool(call("read_document", r#"{"doc_id": "4983"}"#, 200)).await?.into_inner();
    assert!(capped.truncated && capped.observation.chars().count() <= 200);

    // Bad input: the right code, and a message naming the field.
    for (request, code, needle) in [
        (call("web_search", "{}", 0), Code::InvalidArgument, "unknown tool"),
        (call("bm25_search", "{\"query\": ", 0), Code::InvalidArgument, "not valid JSON"),
        (
            call("bm25_search", r#"{"query": "x", "k": 500}"#, 0),
            Code::InvalidArgument,
            "k must be an integer from 1 to 50, got 500",
        ),
        (call("bm25_search", r#"{"query": ""}"#, 0), Code::InvalidArgument, "query must not be empty"),
        (call("read_document", r#"{"doc_id": "no-such-doc"}"#, 0), Code::NotFound, "no-such-doc"),
        (
            pb::CallToolRequest { collection: "nope".into(), ..call("bm25_search", r#"{"query": "x"}"#, 0) },
            Code::NotFound,
            "\"nope\"",
        ),
    ] {
        let status = tools.call_tool(request).await.unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(needle), "{:?} lacks {needle:?}", status.message());
    }
    let huge = serde_json::json!({"query": "cancer ".repeat(20_000)}).to_string();
    tools.call_tool(call("bm25_search", &huge, 1200)).await?;
    let status = tools
        .search(pb::SearchRequest {
            collection: "scifact".into(),
            query: "x".into(),
            k: 0,
            method: pb::SearchMethod::Bm25 as i32,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("k must be between 1 and 1000, got 0"), "{}", status.message());

    // 64 concurrent callers, no errors, same answers as alone.
    let alone = tools
        .search(pb::SearchRequest {
            collection: "scifact".into(),
            query: "vitamin D deficiency".into(),
            k: 10,
            method: 1,
        })
        .await?
        .into_inner();
    let mut callers = Vec::new();
    for caller in 0..64 {
        let mut tools = client(&gateway).await?;
        callers.push(tokio::spawn(async move {
            for _ in 0..5 {
                let query = if caller % 2 == 0 { "vitamin D deficiency" } else { "gene expression in T cells" };
                let response = tools
                    .search(pb::SearchRequest { collection: "scifact".into(), query: query.into(), k: 10, method: 1 })
                    .await?
                    .into_inner();
                anyhow::ensure!(response.hits.len() == 10, "caller {caller} got {} hits", response.hits.len());
                if caller % 2 == 0 {
                    return Ok(Some(response.hits.iter().map(|h| h.doc_id.clone()).collect::<Vec<_>>()));
                }
            }
            Ok(None)
        }));
    }
    let expected: Vec<String> = alone.hits.iter().map(|h| h.doc_id.clone()).collect();
    for caller in callers {
        if let Some(ids) = caller.await?? {
            assert_eq!(ids, expected);
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vector_search_on_scifact_matches_the_published_figure_and_is_served() -> Result<()> {
    // Embedding SciFact takes minutes: `make test-fixtures` does it once, before any test's clock starts.
    let index = sleuth_testkit::prepared_fixture(sleuth_testkit::SCIFACT_VECTORS, "manifest.json")?;
    let source = sleuth_testkit::beir_collection("scifact")?;
    let collection = tool_gateway::collection::Collection::open(&index, index.display().to_string())?;
    let model = tool_gateway::embed::default_model_dir().context("model")?;
    let encoder = tool_gateway::embed::Encoder::load(&model, tch::Device::Cpu)?;
    let beir = sleuth_beir::BeirDir::new(&source);
    let qrels = beir.qrels("test")?;
    let queries: Vec<_> =
        beir.queries(sleuth_beir::BadLines::Fail)?.into_iter().filter(|q| qrels.contains_key(&q.id)).collect();
    let vectors = encoder.encode_all(&queries.iter().map(|q| q.text.clone()).collect::<Vec<_>>(), 32, &mut |_| {})?;
    let mut rankings = std::collections::BTreeMap::new();
    for (query, vector) in queries.iter().zip(&vectors) {
        let hits = collection.vector_search(vector, 100)?;
        rankings.insert(
            query.id.clone(),
            hits.iter().map(|h| collection.document(h.ordinal).id.clone()).collect::<Vec<_>>(),
        );
    }
    let summary = sleuth_metrics::evaluate(&rankings, &qrels);
    // all-MiniLM-L6-v2 on SciFact: 0.6451 in the MTEB leaderboard; 0.645 with sentence-transformers here.
    assert!((summary.ndcg_at_10 - 0.645).abs() <= 0.02, "nDCG@10 {:.4}", summary.ndcg_at_10);
    drop(collection);

    let gateway = start(vec![("scifact".into(), index.display().to_string())], S3Args::default()).await?;
    let mut tools = client(&gateway).await?;
    let listed = tools.list_tools(pb::ListToolsRequest { collection: "scifact".into() }).await?.into_inner();
    assert!(listed.tools.iter().any(|t| t.name == "vector_search"));
    assert!(listed.tools.iter().any(|t| t.name == "hybrid_search"));
    let fused = tools
        .search(pb::SearchRequest {
            collection: "scifact".into(),
            query: "vitamin D deficiency".into(),
            k: 10,
            method: pb::SearchMethod::Hybrid as i32,
        })
        .await?
        .into_inner();
    assert_eq!(fused.hits.len(), 10);
    // The model's hybrid_search call runs the same fusion as Search does.
    let called = tools
        .call_tool(pb::CallToolRequest {
            collection: "scifact".into(),
            name: "hybrid_search".into(),
            arguments_json: serde_json::json!({"query": "vitamin D deficiency", "k": 10}).to_string(),
            observation_char_cap: 0,
            episode_id: String::new(),
            ranking_depth: 0,
            word_stats: false,
        })
        .await?
        .into_inner();
    assert!(called.observation.starts_with("hybrid_search results"), "{}", called.observation);
    let ids = |hits: &[pb::SearchHit]| hits.iter().map(|h| h.doc_id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&called.hits), ids(&fused.hits));
    let request = |query: &str| pb::CallToolRequest {
        collection: "scifact".into(),
        name: "vector_search".into(),
        arguments_json: serde_json::json!({"query": query, "k": 3}).to_string(),
        observation_char_cap: 1200,
        episode_id: String::new(),
        ranking_depth: 0,
        word_stats: false,
    };
    let found = tools.call_tool(request("how does the newborn brain's white matter develop?")).await?.into_inner();
    assert_eq!(found.hits.len(), 3);
    assert!(found.hits.iter().any(|h| h.doc_id == "4983"), "{:?}", found.hits);
    let mut callers = Vec::new();
    for _ in 0..64 {
        let mut tools = client(&gateway).await?;
        let request = request("vitamin D and bone health");
        callers.push(tokio::spawn(async move { tools.call_tool(request).await }));
    }
    let mut first = None;
    for caller in callers {
        let hits: Vec<String> = caller.await??.into_inner().hits.into_iter().map(|h| h.doc_id).collect();
        assert_eq!(hits, *first.get_or_insert_with(|| hits.clone()), "batched answers must not depend on the batch");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bm25_quality_on_scifact_matches_the_published_figure() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let index = scifact_index(scratch.path())?;
    let source = sleuth_testkit::beir_collection("scifact")?;
    let collection = tool_gateway::collection::Collection::open(std::path::Path::new(&index), index.clone())?;
    let beir = sleuth_beir::BeirDir::new(&source);
    let qrels = beir.qrels("test")?;
    let mut rankings = std::collections::BTreeMap::new();
    for query in beir.queries(sleuth_beir::BadLines::Fail)?.into_iter().filter(|q| qrels.contains_key(&q.id)) {
        let hits = collection.bm25(&query.text, 100)?;
        rankings.insert(query.id, hits.iter().map(|h| collection.document(h.ordinal).id.clone()).collect::<Vec<_>>());
    }
    let summary = sleuth_metrics::evaluate(&rankings, &qrels);
    assert_eq!(summary.evaluated, 300);
    // BEIR's published BM25 on SciFact is 0.665; bm25s with these settings 0.676.
    assert!((summary.ndcg_at_10 - 0.665).abs() <= 0.02, "nDCG@10 {:.4}", summary.ndcg_at_10);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_publishes_to_s3_and_loads_a_collection() -> Result<()> {
    let source = tempfile::tempdir()?;
    std::fs::write(
        source.path().join("corpus.jsonl"),
        concat!(
            "{\"_id\": \"d1\", \"title\": \"Rainfall\", \"text\": \"Clouds release rain when droplets grow heavy.\"}\n",
            "this line is broken\n",
            "{\"_id\": \"d2\", \"title\": \"Volcanoes\", \"text\": \"Magma rises through the crust.\"}\n",
        ),
    )?;
    std::fs::write(source.path().join("queries.jsonl"), "{\"_id\": \"q1\", \"text\": \"why does it rain\"}\n")?;
    let s3_server = sleuth_testkit::s3()?;
    // SAFETY: nextest runs each test in its own process; nothing else reads the environment concurrently.
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", "sleuth-test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "sleuth-test-secret");
    }
    let s3 = S3Args { s3_endpoint: Some(sleuth_testkit::s3_endpoint(&s3_server)), ..S3Args::default() };
    if let sleuth_store::ObjectStore::S3 { client, .. } = sleuth_store::ObjectStore::open("s3://indexes", &s3)? {
        client.create_bucket().bucket("indexes").send().await?;
    }
    // Administration has its own token, and requests may name local paths
    // only inside the index root and SLEUTH_COLLECTION_ROOTS.
    let sources = source.path().to_owned();
    let gateway = start_with(Vec::new(), s3.clone(), |config| {
        config.collection_roots = vec![sources];
        config.serve.auth_token = Some("mesh-secret".parse().expect("token"));
        config.admin.admin_token = Some("admin-secret".parse().expect("token"));
        config.rm3_tool = false;
    })
    .await?;
    let mut tools = client_with(&gateway, Some("admin-secret")).await?;
    let mut mesh = client_with(&gateway, Some("mesh-secret")).await?;

    let create = |skip_bad_lines| pb::CreateCollectionRequest {
        name: "weather".into(),
        source_uri: source.path().display().to_string(),
        bm25: None,
        vector: Some(pb::VectorOptions { disabled: true, ..Default::default() }),
        skip_bad_lines,
    };
    let denied = mesh.create_collection(create(true)).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "the mesh token does not open administration: {denied:?}");
    assert!(denied.message().contains("SLEUTH_ADMIN_TOKEN"), "{}", denied.message());
    let elsewhere = tempfile::tempdir()?;
    std::fs::copy(source.path().join("corpus.jsonl"), elsewhere.path().join("corpus.jsonl"))?;
    let outside = pb::CreateCollectionRequest { source_uri: elsewhere.path().display().to_string(), ..create(true) };
    let escaping = pb::CreateCollectionRequest {
        source_uri: format!("{}/../{}", source.path().display(), elsewhere.path().display()),
        ..create(true)
    };
    for request in [outside, escaping] {
        let refused = tools.create_collection(request).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
        assert!(refused.message().contains("SLEUTH_COLLECTION_ROOTS"), "{}", refused.message());
    }
    let refused = tools
        .load_collection(pb::LoadCollectionRequest { name: "etc".into(), index_uri: "/etc".into() })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");

    let mut failing = tools.create_collection(create(false)).await?.into_inner();
    let mut failure = None;
    while let Some(message) = failing.message().await.transpose() {
        if let Err(status) = message {
            failure = Some(status);
        }
    }
    let failure = failure.context("a malformed line fails the ingest")?;
    assert_eq!(failure.code(), Code::InvalidArgument);
    assert!(failure.message().contains("corpus.jsonl:2"), "{}", failure.message());

    let mut progress = tools.create_collection(create(true)).await?.into_inner();
    let mut last = None;
    while let Some(message) = progress.message().await? {
        last = Some(message);
    }
    let last = last.context("progress stream ends with a final message")?;
    assert!(last.done);
    assert_eq!((last.done_items, last.skipped_lines), (2, 1));

    let refused = tools
        .publish_collection(pb::PublishCollectionRequest {
            name: "weather".into(),
            destination_uri: elsewhere.path().join("published").display().to_string(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "no writing outside the roots: {refused:?}");
    let found = mesh.search(pb::SearchRequest { collection: "weather".into(), query: "rain".into(), k: 5, method: 1 });
    assert_eq!(found.await?.into_inner().hits.len(), 1, "the mesh token still opens searches");
    // An optional tool this gateway was not asked to offer is neither listed nor run.
    let listed = mesh.list_tools(pb::ListToolsRequest { collection: "weather".into() }).await?.into_inner();
    assert!(listed.tools.iter().all(|t| t.name != "rm3_search"), "{:?}", listed.tools);
    let rm3 = pb::CallToolRequest {
        collection: "weather".into(),
        name: "rm3_search".into(),
        arguments_json: r#"{"query": "rain"}"#.into(),
        ..Default::default()
    };
    let refused = mesh.call_tool(rm3).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("\"rm3_search\" (not enabled on this gateway"), "{}", refused.message());
    let published = tools
        .publish_collection(pb::PublishCollectionRequest {
            name: "weather".into(),
            destination_uri: "s3://indexes/weather/v1".into(),
        })
        .await?
        .into_inner();
    assert!(published.bytes > 0);
    tools.delete_collection(pb::DeleteCollectionRequest { name: "weather".into() }).await?;
    let gone = mesh.list_tools(pb::ListToolsRequest { collection: "weather".into() }).await.unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);

    // A second gateway loads the published index at startup, straight from S3.
    let replica = start(vec![("weather".into(), "s3://indexes/weather/v1".into())], s3).await?;
    let hits = client(&replica)
        .await?
        .search(pb::SearchRequest { collection: "weather".into(), query: "rain".into(), k: 5, method: 1 })
        .await?
        .into_inner()
        .hits;
    assert_eq!(hits.iter().map(|h| h.doc_id.as_str()).collect::<Vec<_>>(), ["d1"]);
    Ok(())
}

/// A message past tonic's 4 MiB default (a 6 MiB document) goes through a
/// sized server and client (`sleuth_kit::sized!`, 16 MiB, from the episode
/// budget); a client left at the default refuses it by name instead of
/// failing some other way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_past_the_grpc_default_pass_within_the_mesh_limit() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let source = dir.path().join("big");
    std::fs::create_dir_all(&source)?;
    let text = "rain ".repeat(6 << 20 >> 2).trim_end().to_owned(); // about 7.5 MB
    let document = serde_json::json!({"_id": "d1", "title": "Rain", "text": text});
    std::fs::write(source.join("corpus.jsonl"), format!("{document}\n"))?;
    std::fs::write(source.join("queries.jsonl"), "{\"_id\": \"q1\", \"text\": \"rain\"}\n")?;
    let index = dir.path().join("big-index");
    let beir = sleuth_beir::BeirDir::new(&source);
    let bm25 = tool_gateway::bm25::Bm25Options::default();
    tool_gateway::index::build(&beir, &index, "big", &bm25, sleuth_beir::BadLines::Fail, None, &mut |_| {})?;
    let gateway = start(vec![("big".into(), index.display().to_string())], S3Args::default()).await?;
    let request = || pb::GetDocumentRequest { collection: "big".into(), doc_id: "d1".into() };
    assert!(text.len() > 4 << 20 && text.len() < sleuth_kit::limits::MAX_MESSAGE_BYTES);

    let mut sized = sleuth_kit::sized!(client(&gateway).await?);
    let read = sized.get_document(request()).await?.into_inner();
    assert_eq!(read.text.len(), text.len());

    let refused = client(&gateway).await?.get_document(request()).await.unwrap_err();
    assert_eq!(refused.code(), Code::OutOfRange, "{refused:?}");
    assert!(refused.message().contains("message length too large"), "{}", refused.message());
    Ok(())
}
