//! What a platform team meets installing the chart: tokens made once in the
//! cluster so GitOps renders never change them, a schema that takes an
//! umbrella chart's `global`, the declared Kubernetes version, another
//! cluster domain, and one values file per install scenario that renders
//! valid manifests.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use sleuth_testkit::find_tool;
use sleuth_testkit::kube_api::FakeKubeApi;
use sleuth_tests::helm::{
    chart_dir, document, documents, env_line, has_line, helm_template, helm_template_with, validate,
};

/// Runs a rendered hook Job's `sleuth auth ensure-secret` here, against `api`.
fn run_hook_job(job: &str, api: &FakeKubeApi) -> Result<String> {
    let line = job
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("command: [\"/usr/local/bin/sleuth\", \"auth\""))
        .context("no `sleuth auth` command in the Job")?;
    let command: Vec<String> = serde_json::from_str(line.trim_start_matches("command: "))?;
    let output = Command::new(sleuth_tests::binary("sleuth")?)
        .args(&command[1..])
        .env("KUBECONFIG", api.kubeconfig())
        .output()?;
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    ensure!(output.status.success(), "{command:?} failed:\n{printed}");
    Ok(printed)
}

/// Argo CD and Flux render the chart with `helm template`, where `lookup`
/// finds nothing: a chart that made random tokens in a render changed them
/// on every sync, and old and new pods refused each other. The tokens are
/// now made by a pre-install/pre-upgrade hook Job in the cluster; every
/// render is the same, and the Job, run twice, makes the Secret the pods
/// mount once and then leaves it alone.
// The fake API serves on this runtime while the test blocks on the CLI process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_made_once_in_the_cluster_and_every_render_is_the_same() -> Result<()> {
    let first = helm_template(&[])?;
    ensure!(first == helm_template(&[])?, "two renders of the same values differ");
    validate(&first)?;
    let docs = documents(&first);
    assert!(!docs.iter().any(|d| d.contains("\nkind: Secret\n")), "a render holds a Secret (and so its tokens)");
    let job = document(&docs, "Job", "ci-release-auth-init")?;
    assert!(has_line(job, "helm.sh/hook: pre-install,pre-upgrade"), "{job}");
    let role = document(&docs, "Role", "ci-release-auth-init")?;
    assert!(role.contains("resourceNames: [\"ci-release-auth\"]"), "get and patch only the token Secret:\n{role}");

    let api = FakeKubeApi::start().await?;
    let printed = run_hook_job(job, &api)?;
    assert!(printed.contains("created secret"), "{printed}");
    let secret = api.secret("ci-release-auth").context("the hook made no Secret ci-release-auth")?;
    run_hook_job(job, &api)?;
    assert_eq!(api.secret("ci-release-auth"), Some(secret.clone()), "a second hook run changed the tokens");

    // Every key a pod mounts is in the Secret the hook made.
    let mut mounted_keys = 0;
    for doc in docs.iter().filter(|d| d.contains("secretName: ci-release-auth\n")) {
        let mounted = doc.split("secretName: ci-release-auth\n").nth(1).context("the auth volume")?;
        for key in mounted
            .lines()
            .take_while(|l| !l.trim_start().starts_with("- name:"))
            .filter_map(|l| l.trim().strip_prefix("- key: "))
        {
            assert!(secret["data"][key].is_string(), "a pod mounts key {key}, which the Secret lacks");
            mounted_keys += 1;
        }
    }
    assert!(mounted_keys >= 6, "only {mounted_keys} token mounts found");

    // With the operator's own Secret there is nothing to make.
    let own = helm_template(&["auth.existingSecret=mesh-tokens"])?;
    assert!(!own.contains("ci-release-auth-init"), "no hook with auth.existingSecret");
    Ok(())
}

/// An umbrella chart passes `global` to every subchart; the schema took it
/// for a misspelt key. The chart declares the Kubernetes it needs (the
/// learner's ranks read the pod-index label, 1.28+), and the ranks' stable
/// names follow the cluster's DNS domain.
#[test]
fn umbrella_charts_older_clusters_and_other_domains() -> Result<()> {
    validate(&helm_template(&["global.imageRegistry=registry.internal"])?)?;

    let old = Command::new(find_tool("helm")?)
        .args(["template", "ci-release", "--kube-version", "1.27.0"])
        .arg(chart_dir())
        .output()?;
    ensure!(!old.status.success(), "the chart rendered for Kubernetes 1.27");
    let error = String::from_utf8_lossy(&old.stderr);
    assert!(error.contains("kubeVersion") || error.contains("1.28"), "{error}");

    let ranked = helm_template(&[
        "clusterDomain=corp.internal",
        "components.learner.replicas=2",
        "components.learner.checkpointUri=s3://checkpoints/runs",
        "database.existingSecret=postgres-url",
    ])?;
    let learner = document(&documents(&ranked), "StatefulSet", "ci-release-learner")?;
    assert_eq!(
        env_line(learner, "MASTER_ADDR").as_deref(),
        Some("value: \"ci-release-learner-0.ci-release-learner-ranks.default.svc.corp.internal\"")
    );
    Ok(())
}

/// Each install scenario has a values file that renders manifests
/// Kubernetes' schemas accept, and sets what the scenario needs: the pods'
/// identity for S3 without keys (IRSA), TLS databases with their CA mounted
/// where the URL names it, GPUs (`values-l40s.yaml`, tested in chart.rs).
#[test]
fn every_install_scenario_renders_valid_manifests() -> Result<()> {
    for values in ["values-irsa.yaml", "values-external-tls.yaml", "values-l40s.yaml"] {
        validate(&helm_template_with(Some(values), &[])?).with_context(|| values.to_owned())?;
    }

    let irsa = helm_template_with(Some("values-irsa.yaml"), &[])?;
    let docs = documents(&irsa);
    let account = document(&docs, "ServiceAccount", "ci-release")?;
    assert!(has_line(account, "eks.amazonaws.com/role-arn: arn:aws:iam::111122223333:role/sleuth"), "{account}");
    assert!(!irsa.contains("secretRef"), "IRSA needs no key Secret");
    for doc in docs.iter().filter(|d| d.contains("\nkind: Deployment\n") || d.contains("\nkind: StatefulSet\n")) {
        assert!(doc.contains("serviceAccountName: ci-release\n"), "every pod runs as the annotated account:\n{doc}");
    }

    let tls = helm_template_with(Some("values-external-tls.yaml"), &[])?;
    let docs = documents(&tls);
    for (kind, name) in [("Deployment", "ci-release-rollout-orchestrator"), ("StatefulSet", "ci-release-learner")] {
        let doc = document(&docs, kind, name)?;
        assert!(doc.contains("mountPath: /etc/sleuth/database-ca\n") && doc.contains("name: rds-ca\n"), "{name}");
    }
    let gateway = document(&docs, "Deployment", "ci-release-inference-gateway")?;
    assert!(!gateway.contains("database-ca"), "the inference gateway has no database");
    assert!(env_line(gateway, "SLEUTH_REDIS_CA_FILE").is_none(), "ElastiCache's roots are public: no Redis CA");

    let private = helm_template(&["redis.caConfigMap=redis-ca"])?;
    let gateway = document(&documents(&private), "Deployment", "ci-release-inference-gateway")?;
    assert_eq!(env_line(gateway, "SLEUTH_REDIS_CA_FILE").as_deref(), Some("value: /etc/sleuth/redis-ca/ca.crt"));
    Ok(())
}
