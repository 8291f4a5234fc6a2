//! The Helm chart renders, passes Kubernetes schema validation offline, and
//! only sets environment variables that the binaries it runs understand.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use sleuth_testkit::find_tool;

fn chart_dir() -> std::path::PathBuf {
    sleuth_testkit::checkout_file("helm/sleuth")
}

fn helm_template(sets: &[&str]) -> Result<String> {
    helm_template_with(None, sets)
}

/// `helm template` with the chart's example values file `values` (e.g.
/// `values-l40s.yaml`) on top of the defaults, then `sets`.
fn helm_template_with(values: Option<&str>, sets: &[&str]) -> Result<String> {
    let mut command = Command::new(find_tool("helm")?);
    command.args(["template", "ci-release"]).arg(chart_dir());
    if let Some(values) = values {
        command.arg("-f").arg(chart_dir().join(values));
    }
    for set in sets {
        command.args(["--set", set]);
    }
    let output = command.output().context("running helm template")?;
    ensure!(output.status.success(), "helm template failed: {}", String::from_utf8_lossy(&output.stderr));
    Ok(String::from_utf8(output.stdout)?)
}

fn validate(manifests: &str) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("rendered.yaml");
    std::fs::write(&path, manifests)?;
    let output = Command::new(find_tool("kubernetes-validate")?).args(["--strict", "--quiet"]).arg(&path).output()?;
    ensure!(
        output.status.success(),
        "kubernetes-validate rejected the chart:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// (binary, SLEUTH_* variable names, readiness gRPC service) of each
/// Deployment or StatefulSet (the learner's ranks).
fn deployments(manifests: &str) -> Vec<(String, Vec<String>, Option<String>)> {
    manifests
        .split("\n---")
        .filter(|doc| doc.contains("\nkind: Deployment") || doc.contains("\nkind: StatefulSet"))
        .map(|doc| {
            let binary = doc
                .lines()
                .find_map(|l| l.trim().strip_prefix("command: [\"/usr/local/bin/"))
                .map(|rest| rest.trim_end_matches("\"]").to_owned())
                .unwrap_or_default();
            let env = doc
                .lines()
                .filter_map(|l| l.trim().strip_prefix("- name: "))
                .filter(|name| name.starts_with("SLEUTH_"))
                .map(str::to_owned)
                .collect();
            let probe = doc.lines().find_map(|l| l.trim().strip_prefix("service: ")).map(str::to_owned);
            (binary, env, probe)
        })
        .collect()
}

#[test]
fn chart_renders_valid_manifests_with_known_settings() -> Result<()> {
    let defaults = helm_template(&[])?;
    let production = helm_template(&[
        "auth.existingSecret=mesh-token",
        "database.existingSecret=postgres-url",
        "telemetry.otlpEndpoint=http://otel-collector:4317",
        "components.policyServer.device=cuda:0",
    ])?;
    validate(&defaults)?;
    validate(&production)?;

    for manifests in [&defaults, &production] {
        let found = deployments(manifests);
        let mut binaries: Vec<_> = found.iter().map(|(b, _, _)| b.as_str()).collect();
        binaries.sort();
        let mut expected = sleuth_tests::SERVICES.to_vec();
        expected.sort();
        assert_eq!(binaries, expected, "one workload per service");

        for (binary, env, probe) in &found {
            let help = Command::new(sleuth_tests::binary(binary)?).arg("--help").output()?;
            let help = String::from_utf8(help.stdout)?;
            for name in env {
                assert!(
                    help.contains(&format!("env: {name}")),
                    "chart sets {name} for {binary}, which does not read it"
                );
            }
            let probe = probe.as_deref().unwrap_or_default();
            assert!(probe.starts_with("sleuth."), "{binary} has no gRPC readiness probe on its own service: {probe:?}");
        }
    }
    // Scopes: only the learner and the policy servers hold the publication
    // token, only the tool gateway and the orchestrator the administration one.
    for (binary, env, _) in deployments(&defaults) {
        let holds = |name: &str| env.iter().any(|e| e == name);
        let publish = matches!(binary.as_str(), "learner" | "policy-server");
        let admin = matches!(binary.as_str(), "tool-gateway" | "rollout-orchestrator");
        assert_eq!(holds("SLEUTH_PUBLISH_TOKEN_FILE"), publish, "{binary} and the publication token");
        assert_eq!(holds("SLEUTH_ADMIN_TOKEN_FILE"), admin, "{binary} and the administration token");
    }
    let unscoped = helm_template(&["auth.scopes=false"])?;
    validate(&unscoped)?;
    assert!(!unscoped.contains("SLEUTH_PUBLISH_TOKEN_FILE") && !unscoped.contains("SLEUTH_ADMIN_TOKEN_FILE"));
    assert!(production.contains("secretName: mesh-token"));
    assert!(!production.contains("kind: Secret"), "an existing secret must not be replaced");
    assert!(defaults.contains("kind: Secret"), "the chart creates the token secret when none is given");
    Ok(())
}

/// Names of the form `sleuth_<lowercase and _>` in `text`, in order.
fn metric_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("sleuth_") {
        let name: String =
            rest[at..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_').collect();
        rest = &rest[at + name.len()..];
        names.push(name);
    }
    names
}

/// Every `.rs` file under `dir`, concatenated.
fn sources(dir: &std::path::Path) -> Result<String> {
    let mut text = String::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            text.push_str(&sources(&path)?);
        } else if path.extension().is_some_and(|e| e == "rs") {
            text.push_str(&std::fs::read_to_string(&path)?);
        }
    }
    Ok(text)
}

/// The metrics reference (docs/observability.md), the Grafana dashboard
/// (deploy/grafana/sleuth.json) and the services agree: the dashboard charts
/// every listed metric and no other, every metric a service registers is
/// listed, and the training panels read step metrics the learner records.
#[test]
fn the_dashboard_and_the_metrics_reference_match_the_services() -> Result<()> {
    use std::collections::BTreeSet;
    let doc = std::fs::read_to_string(sleuth_testkit::checkout_file("docs/observability.md"))?;
    let listed: BTreeSet<String> =
        doc.lines().filter(|l| l.starts_with("| `sleuth_")).flat_map(|l| metric_names(l).into_iter().take(1)).collect();
    ensure!(listed.len() >= 20, "the reference lists {listed:?}");

    let mut registered = BTreeSet::new();
    for service in sleuth_tests::SERVICES {
        let code = sources(&sleuth_testkit::checkout_file(&format!("services/{service}/src")))?;
        for maker in ["counter(", "gauge(", "counter_vec(", "gauge_vec(", "histogram("] {
            for (at, _) in code.match_indices(maker) {
                let call = code[at + maker.len()..].trim_start();
                if let Some(name) = call.strip_prefix('"').map(metric_names).and_then(|n| n.into_iter().next()) {
                    registered.insert(name);
                }
            }
        }
    }
    assert_eq!(listed, registered, "docs/observability.md lists exactly the metrics the services register");

    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sleuth_testkit::checkout_file("deploy/grafana/sleuth.json"))?)?;
    let targets: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .context("panels")?
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .collect();
    let charted: BTreeSet<String> = targets
        .iter()
        .filter_map(|t| t["expr"].as_str())
        .flat_map(metric_names)
        .map(|name| name.strip_suffix("_bucket").map(str::to_owned).unwrap_or(name))
        .collect();
    assert_eq!(charted, listed, "the dashboard charts every listed metric, and only those");

    let recorded = serde_json::to_value(learner::trainer::StepStats::default())?;
    for query in targets.iter().filter_map(|t| t["rawSql"].as_str()).filter(|q| q.contains("learner_steps")) {
        let key = query.split("->>'").nth(1).and_then(|rest| rest.split('\'').next()).context("a step metric")?;
        assert!(recorded.get(key).is_some(), "the dashboard charts {key:?}, which the learner does not record");
    }
    Ok(())
}

/// A multi-rank learner renders as a StatefulSet whose pods take their rank
/// from their ordinal, the world size from the replica count and rank 0's
/// stable name (through a headless Service that names pods before they are
/// ready) as the rendezvous; a single learner sets no rank variables.
#[test]
fn a_multi_rank_learner_is_a_statefulset_whose_pods_know_their_rank() -> Result<()> {
    let manifests = helm_template(&["components.learner.replicas=3", "components.learner.collectivePort=29501"])?;
    validate(&manifests)?;
    let docs: Vec<&str> = manifests.split("\n---").collect();
    let learner = docs
        .iter()
        .find(|d| d.contains("\nkind: StatefulSet") && d.contains("name: ci-release-learner\n"))
        .context("the learner's StatefulSet")?;
    for line in [
        "replicas: 3",
        "serviceName: ci-release-learner-ranks",
        "podManagementPolicy: Parallel",
        "fieldPath: metadata.labels['apps.kubernetes.io/pod-index']",
        "containerPort: 29501",
    ] {
        assert!(learner.lines().any(|l| l.trim() == line), "{line:?} missing from\n{learner}");
    }
    let env = |name: &str| {
        let at = learner.find(&format!("- name: {name}\n"))?;
        learner[at..].lines().nth(1).map(|l| l.trim().to_owned())
    };
    assert_eq!(env("RANK").as_deref(), Some("valueFrom:"));
    assert_eq!(env("WORLD_SIZE").as_deref(), Some("value: \"3\""));
    assert_eq!(
        env("MASTER_ADDR").as_deref(),
        Some("value: \"ci-release-learner-0.ci-release-learner-ranks.default.svc.cluster.local\"")
    );
    assert_eq!(env("MASTER_PORT").as_deref(), Some("value: \"29501\""));
    let ranks = docs
        .iter()
        .find(|d| d.contains("\nkind: Service") && d.contains("name: ci-release-learner-ranks\n"))
        .context("the ranks' headless Service")?;
    for line in ["clusterIP: None", "publishNotReadyAddresses: true", "port: 29501"] {
        assert!(ranks.lines().any(|l| l.trim() == line), "{line:?} missing from\n{ranks}");
    }

    let single = helm_template(&[])?;
    assert!(!single.contains("name: RANK"), "one learner needs no rendezvous");
    Ok(())
}

/// `helm lint --strict` passes, and values.schema.json turns away a wrong
/// type, a misspelt key and a bad run id, naming each.
#[test]
fn the_values_schema_rejects_bad_values_by_name() -> Result<()> {
    let lint = Command::new(find_tool("helm")?).args(["lint", "--strict"]).arg(chart_dir()).output()?;
    ensure!(lint.status.success(), "helm lint --strict: {}", String::from_utf8_lossy(&lint.stdout));
    for (set, named) in [
        ("components.learner.replicas=three", "/components/learner/replicas"),
        ("components.agent.replicass=3", "replicass"),
        ("components.learner.runId=../other", "/components/learner/runId"),
        ("telemetry.otlpEndpoint=collector:4317", "/telemetry/otlpEndpoint"),
        ("components.policyServer.device=gpu", "/components/policyServer/device"),
    ] {
        let error = helm_template(&[set]).err().with_context(|| format!("{set} was accepted"))?.to_string();
        assert!(error.contains(named), "{set}: {error}");
    }
    Ok(())
}

/// The example values for L40S nodes render valid manifests that put one GPU
/// under each policy server and learner rank, on L40S nodes with the nvidia
/// runtime, and nothing GPU-bound elsewhere.
#[test]
fn the_l40s_values_schedule_policy_servers_and_learner_ranks_on_gpus() -> Result<()> {
    let manifests = helm_template_with(Some("values-l40s.yaml"), &[])?;
    validate(&manifests)?;
    for doc in
        manifests.split("\n---").filter(|d| d.contains("\nkind: Deployment") || d.contains("\nkind: StatefulSet"))
    {
        let gpu = doc.contains("name: ci-release-policy-server\n") || doc.contains("name: ci-release-learner\n");
        for line in ["nvidia.com/gpu: 1", "nvidia.com/gpu.product: NVIDIA-L40S", "runtimeClassName: nvidia"] {
            assert_eq!(doc.lines().any(|l| l.trim() == line), gpu, "{line:?} in\n{doc}");
        }
        if gpu {
            assert!(doc.contains("value: \"cuda\""), "SLEUTH_DEVICE cuda in\n{doc}");
        }
    }
    assert!(manifests.contains("name: WORLD_SIZE"), "two learner ranks rendezvous");
    Ok(())
}

/// By default the orchestrator, the inference gateway and the learner follow
/// the ready pods of the agents and policy servers through their
/// EndpointSlices, as a ServiceAccount whose Role can only read
/// endpointslices; with discovery off, each gets one Service address and no
/// account is made.
#[test]
fn upstreams_are_discovered_through_endpointslices_with_a_read_only_role() -> Result<()> {
    let manifests = helm_template(&[])?;
    validate(&manifests)?;
    let docs: Vec<&str> = manifests.split("\n---").collect();
    let workload = |binary: &str| {
        docs.iter()
            .find(|d| d.contains(&format!("command: [\"/usr/local/bin/{binary}\"]")))
            .copied()
            .with_context(|| format!("no {binary} workload"))
    };
    let env = |doc: &str, name: &str| {
        let at = doc.find(&format!("- name: {name}\n"))?;
        doc[at..].lines().nth(1).map(|l| l.trim().to_owned())
    };
    for (binary, name, value) in [
        ("rollout-orchestrator", "SLEUTH_AGENT_WORKERS", "kube://ci-release-agent:grpc"),
        ("inference-gateway", "SLEUTH_POLICY_SERVERS", "kube://ci-release-policy-server:grpc"),
        ("learner", "SLEUTH_POLICY_SERVERS", "kube://ci-release-policy-server:grpc"),
    ] {
        let doc = workload(binary)?;
        assert_eq!(env(doc, name), Some(format!("value: \"{value}\"")), "{binary}");
        assert!(doc.contains("serviceAccountName: ci-release-discovery\n"), "{binary} runs as the discovery account");
    }
    for binary in ["agent", "tool-gateway", "policy-server"] {
        assert!(!workload(binary)?.contains("serviceAccountName"), "{binary} needs no API access");
    }
    let role = docs.iter().find(|d| d.contains("\nkind: Role\n")).context("the discovery Role")?;
    assert_eq!(role.matches("apiGroups:").count(), 1, "one rule:\n{role}");
    for line in [
        r#"- apiGroups: ["discovery.k8s.io"]"#,
        r#"resources: ["endpointslices"]"#,
        r#"verbs: ["get", "list", "watch"]"#,
    ] {
        assert!(role.lines().any(|l| l.trim() == line), "{line} missing from\n{role}");
    }
    let binding = docs.iter().find(|d| d.contains("\nkind: RoleBinding\n")).context("the RoleBinding")?;
    assert!(binding.contains("name: ci-release-discovery\n") && binding.contains("kind: ServiceAccount"));

    let fixed = helm_template(&["discovery.kubernetes=false"])?;
    validate(&fixed)?;
    let docs: Vec<&str> = fixed.split("\n---").collect();
    let orchestrator = docs
        .iter()
        .find(|d| d.contains("command: [\"/usr/local/bin/rollout-orchestrator\"]"))
        .context("the orchestrator")?;
    assert_eq!(env(orchestrator, "SLEUTH_AGENT_WORKERS").as_deref(), Some("value: \"ci-release-agent:50052\""));
    assert!(!fixed.contains("kind: Role") && !fixed.contains("serviceAccountName"));
    Ok(())
}
