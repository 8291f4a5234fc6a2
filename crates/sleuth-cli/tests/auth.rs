//! `sleuth auth ensure-secret` against a Kubernetes API (the testkit's fake,
//! the real protocol): it creates the token Secret once, never changes a key
//! a Secret holds, and adds only the keys it lacks.

use std::process::Command;

use anyhow::{Result, ensure};
use sleuth_testkit::kube_api::FakeKubeApi;

/// Runs `sleuth auth ensure-secret` against `api`, returning what it printed.
fn ensure_secret(api: &FakeKubeApi, args: &[&str]) -> Result<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_sleuth"))
        .args(["auth", "ensure-secret"])
        .args(args)
        .env("KUBECONFIG", api.kubeconfig())
        .output()?;
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    ensure!(output.status.success(), "sleuth auth ensure-secret {args:?} failed:\n{printed}");
    Ok(printed)
}

// The fake API serves on this runtime while the test blocks on the CLI process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_secret_is_made_once_and_only_completed_after() -> Result<()> {
    let api = FakeKubeApi::start().await?;
    let printed = ensure_secret(&api, &["mesh-auth", "--labels", "app.kubernetes.io/instance=r"])?;
    assert!(printed.contains("created secret sleuth/mesh-auth"), "{printed}");
    let first = api.secret("mesh-auth").expect("the secret was created");
    assert_eq!(first["metadata"]["labels"]["app.kubernetes.io/instance"], "r");
    let data = first["data"].as_object().expect("data").clone();
    assert_eq!(data.keys().collect::<Vec<_>>(), ["admin-token", "publish-token", "ticket-key", "token"]);
    let tokens: Vec<&str> = data.values().filter_map(|v| v.as_str()).collect();
    let distinct: std::collections::BTreeSet<&&str> = tokens.iter().collect();
    assert!(tokens.iter().all(|t| t.len() >= 40) && distinct.len() == 4, "{tokens:?}");
    assert!(!printed.contains(tokens[0]), "a token reached the output:\n{printed}");

    // Every later render and hook run leaves the tokens pods hold as they are.
    let printed = ensure_secret(&api, &["mesh-auth"])?;
    assert!(printed.contains("nothing to do"), "{printed}");
    assert_eq!(api.secret("mesh-auth"), Some(first));

    // An operator's Secret with only the mesh token: the scope tokens are added, the mesh token kept.
    api.set_secret("operators", serde_json::json!({"token": "b3BlcmF0b3ItdG9rZW4="}));
    let printed = ensure_secret(&api, &["operators"])?;
    assert!(printed.contains("added keys publish-token, admin-token, ticket-key"), "{printed}");
    let completed = api.secret("operators").expect("still there");
    assert_eq!(completed["data"]["token"], "b3BlcmF0b3ItdG9rZW4=");
    assert!(completed["data"]["publish-token"].as_str().is_some_and(|t| t.len() >= 40));

    let bad = Command::new(env!("CARGO_BIN_EXE_sleuth"))
        .args(["auth", "ensure-secret", "x", "--keys", "token,a/b"])
        .env("KUBECONFIG", api.kubeconfig())
        .output()?;
    ensure!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--keys"), "a bad key was taken");
    Ok(())
}
