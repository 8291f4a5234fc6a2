//! `sleuth search`: the tool gateway's typed Search.

use std::time::Duration;

use sleuth_kit::BearerToken;
use sleuth_proto::tools::v1::tool_gateway_client::ToolGatewayClient;
use sleuth_proto::tools::v1::{SearchMethod, SearchRequest};

#[derive(clap::Args, Debug)]
pub struct SearchArgs {
    /// Tool gateway address.
    #[arg(long, env = "SLEUTH_TOOL_GATEWAY", default_value = "127.0.0.1:50053")]
    tool_gateway: String,
    /// Collection to search.
    #[arg(long)]
    collection: String,
    /// bm25, vector, hybrid, or rm3 (BM25 with RM3 pseudo-relevance feedback).
    #[arg(long, default_value = "bm25", value_parser = ["bm25", "vector", "hybrid", "rm3"])]
    method: String,
    /// Number of hits.
    #[arg(long, short, default_value_t = 5)]
    k: u32,
    #[arg(long, env = "SLEUTH_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<BearerToken>,
    /// The query.
    query: String,
}

pub async fn run(args: SearchArgs) -> anyhow::Result<()> {
    let channel =
        sleuth_kit::client::connect(&args.tool_gateway, args.auth_token.as_ref(), Duration::from_secs(5)).await?;
    let method = match args.method.as_str() {
        "vector" => SearchMethod::Vector,
        "hybrid" => SearchMethod::Hybrid,
        "rm3" => SearchMethod::Bm25Rm3,
        _ => SearchMethod::Bm25,
    };
    let request = SearchRequest { collection: args.collection, query: args.query, k: args.k, method: method as i32 };
    let response = sleuth_kit::sized!(ToolGatewayClient::new(channel))
        .search(request)
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?;
    let response = response.into_inner();
    for (rank, hit) in response.hits.iter().enumerate() {
        println!("{:>3}. {:>8.4}  {}  {}", rank + 1, hit.score, hit.doc_id, hit.title.trim());
    }
    println!("({} hits in {} µs)", response.hits.len(), response.took_micros);
    Ok(())
}
