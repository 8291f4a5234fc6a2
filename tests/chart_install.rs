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
    for values in ["values-trial.yaml", "values-irsa.yaml", "values-external-tls.yaml", "values-l40s.yaml"] {
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

/// Stopping a pod loses no work it could finish: every pod keeps serving
/// while endpoints forget it (preStop), then drains; an agent gets time for
/// the episodes it runs, the learner for its step and a final checkpoint;
/// the kubelet's grace covers both. A multi-rank learner is updated as one
/// job (OnDelete), never one rank at a time.
#[test]
fn pods_stop_after_finishing_their_work_and_learner_ranks_update_together() -> Result<()> {
    let manifests = helm_template(&[
        "components.learner.replicas=2",
        "components.learner.checkpointUri=s3://checkpoints/runs",
        "database.existingSecret=postgres-url",
    ])?;
    validate(&manifests)?;
    let docs = documents(&manifests);
    let grace = |doc: &str| -> Option<u64> {
        doc.lines().find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds: ")).and_then(|v| v.parse().ok())
    };
    for (kind, binary, drain, at_least) in [
        ("Deployment", "agent", "300s", 300),
        ("StatefulSet", "learner", "10s", 900),
        ("Deployment", "tool-gateway", "10s", 15),
        ("Deployment", "policy-server", "10s", 15),
    ] {
        let doc = document(&docs, kind, &format!("ci-release-{binary}"))?;
        assert_eq!(env_line(doc, "SLEUTH_DRAIN_TIMEOUT"), Some(format!("value: \"{drain}\"")), "{binary}");
        let seconds = grace(doc).with_context(|| format!("{binary} has no grace period"))?;
        assert!(seconds >= at_least, "{binary}: {seconds} s of grace");
        assert!(has_line(doc, "command: [\"/bin/sleep\", \"5\"]"), "{binary} has no preStop pause");
    }
    let learner = document(&docs, "StatefulSet", "ci-release-learner")?;
    assert!(learner.contains("updateStrategy:\n    type: OnDelete"), "{learner}");
    Ok(())
}

/// What charts of this kind ship, off by default: NetworkPolicies (the
/// learner's rendezvous open to learner pods only), an Ingress per HTTP
/// door, a ServiceMonitor; placement per component.
#[test]
fn network_policies_ingress_monitoring_and_placement_render() -> Result<()> {
    let manifests = helm_template(&[
        "networkPolicy.enabled=true",
        "ingress.enabled=true",
        "ingress.dashboard.host=sleuth.example.com",
        "ingress.openai.host=api.example.com",
        "ingress.openai.tlsSecret=api-tls",
        "serviceMonitor.enabled=true",
        "components.policyServer.priorityClassName=gpu-serving",
        "components.agent.topologySpreadConstraints[0].maxSkew=1",
        "components.agent.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
        "components.agent.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
    ])?;
    validate(&manifests)?;
    let docs = documents(&manifests);
    let policy = document(&docs, "NetworkPolicy", "ci-release-learner")?;
    assert!(has_line(policy, "port: grpc") && !policy.contains("learner pods only"), "one rank: gRPC only\n{policy}");
    assert_eq!(docs.iter().filter(|d| d.contains("\nkind: NetworkPolicy\n")).count(), 6);
    let openai = document(&docs, "Ingress", "ci-release-openai")?;
    assert!(openai.contains("name: ci-release-inference-gateway\n") && openai.contains("secretName: api-tls"));
    document(&docs, "Ingress", "ci-release-dashboard")?;
    document(&docs, "ServiceMonitor", "ci-release")?;
    assert!(has_line(document(&docs, "Deployment", "ci-release-policy-server")?, "priorityClassName: gpu-serving"));
    assert!(document(&docs, "Deployment", "ci-release-agent")?.contains("topologyKey: topology.kubernetes.io/zone"));

    let plain = helm_template(&[])?;
    for kind in ["NetworkPolicy", "Ingress", "ServiceMonitor"] {
        assert!(!plain.contains(&format!("\nkind: {kind}\n")), "{kind} is on by default");
    }
    Ok(())
}

/// The chart's README lists every value with the comments values.yaml gives
/// it; it is generated (deploy/chart/readme.py), and must be regenerated
/// when the values change.
#[test]
fn the_chart_readme_is_generated_from_the_current_values() -> Result<()> {
    let output = Command::new("python3")
        .arg(sleuth_testkit::checkout_file("deploy/chart/readme.py"))
        .arg("--check")
        .output()
        .context("running deploy/chart/readme.py (python3)")?;
    ensure!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let readme = std::fs::read_to_string(chart_dir().join("README.md"))?;
    for value in
        ["`serviceAccount.annotations`", "`clusterDomain`", "`components.learner.terminationGracePeriodSeconds`"]
    {
        assert!(readme.contains(value), "{value} missing from the chart README");
    }
    Ok(())
}

/// A first install without Redis or PostgreSQL: both run in the release,
/// with passwords the install hook makes once, and the mesh's URLs name
/// them. The rendered Redis command, run here, gives the durability Sleuth's
/// streams need (every write synced, nothing evicted) behind the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trial_install_runs_redis_and_postgresql_in_the_release() -> Result<()> {
    let trial = ["trial.redis.enabled=true", "trial.postgresql.enabled=true"];
    let manifests = helm_template(&trial)?;
    validate(&manifests)?;
    ensure!(manifests == helm_template(&trial)?, "two renders of the trial differ");
    let docs = documents(&manifests);
    let learner = document(&docs, "StatefulSet", "ci-release-learner")?;
    assert_eq!(
        env_line(learner, "SLEUTH_REDIS_URL").as_deref(),
        Some("value: \"redis://:$(REDIS_PASSWORD)@ci-release-redis:6379/0\"")
    );
    assert_eq!(
        env_line(learner, "SLEUTH_DATABASE_URL").as_deref(),
        Some("value: \"postgres://sleuth:$(POSTGRES_PASSWORD)@ci-release-postgresql:5432/sleuth\"")
    );
    document(&docs, "StatefulSet", "ci-release-postgresql")?;
    document(&docs, "Service", "ci-release-postgresql")?;

    // The hook makes the passwords once.
    let api = FakeKubeApi::start().await?;
    let job = document(&docs, "Job", "ci-release-auth-init")?;
    let trial_job = job.split("- name: trial-passwords").nth(1).context("the hook's trial container")?;
    run_hook_job(trial_job, &api)?;
    let secret = api.secret("ci-release-trial").context("no trial Secret")?;
    assert!(secret["data"]["postgresql-password"].is_string());
    let password: k8s_openapi::ByteString = serde_json::from_value(secret["data"]["redis-password"].clone())?;
    let password = String::from_utf8(password.0)?;

    // The rendered Redis command, on a loopback port here.
    let redis = document(&docs, "StatefulSet", "ci-release-redis")?;
    let line =
        redis.lines().map(str::trim).find(|l| l.starts_with("command: [\"sh\", \"-c\"")).context("redis command")?;
    let command: Vec<String> = serde_json::from_str(line.trim_start_matches("command: "))?;
    let data = tempfile::tempdir()?;
    let port = sleuth_testkit::free_port()?;
    let script = command[2]
        .replace("exec redis-server", &format!("exec {}", find_tool("redis-server")?.display()))
        .replace("--dir /data", &format!("--dir {}", data.path().display()));
    let mut server = Command::new("sh")
        .args(["-c", &format!("{script} --port {port} --bind 127.0.0.1")])
        .env("REDIS_PASSWORD", &password)
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let checked = async {
        let url = format!("redis://:{password}@127.0.0.1:{port}/0");
        let store = sleuth_store::RedisStore::open(&url)?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while store.ping().await.is_err() {
            ensure!(std::time::Instant::now() < deadline, "the trial Redis did not answer");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let mut connection = store.connection().await?;
        for (setting, expected) in
            [("appendonly", "yes"), ("appendfsync", "always"), ("maxmemory-policy", "noeviction")]
        {
            let got: Vec<String> = redis::cmd("CONFIG").arg("GET").arg(setting).query_async(&mut connection).await?;
            assert_eq!(got, [setting, expected], "{setting}");
        }
        let anonymous = sleuth_store::RedisStore::open(&format!("redis://127.0.0.1:{port}/0"))?;
        ensure!(anonymous.ping().await.is_err(), "the trial Redis answered without its password");
        Ok(())
    }
    .await;
    let _ = server.kill();
    let _ = server.wait();
    checked?;

    let both = helm_template(&["trial.redis.enabled=true", "redis.existingSecret=redis-url"]);
    assert!(both.err().is_some_and(|e| e.to_string().contains("choose one")), "a trial Redis beside an external one");
    Ok(())
}
