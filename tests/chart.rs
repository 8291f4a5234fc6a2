//! The Helm chart renders, passes Kubernetes schema validation offline, and
//! only sets environment variables that the binaries it runs understand.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use sleuth_testkit::find_tool;
use sleuth_tests::helm::{
    chart_dir, deployments, document, documents, env_line, has_line, helm_template, helm_template_with, validate,
};

#[test]
fn chart_renders_valid_manifests_with_known_settings() -> Result<()> {
    let defaults = helm_template(&[])?;
    let production = helm_template(&[
        "auth.existingSecret=mesh-token",
        "database.existingSecret=postgres-url",
        "redis.existingSecret=redis-url",
        "s3.existingSecret=s3-credentials",
        "s3.endpoint=http://minio:9000",
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
    // token, only the tool gateway, the orchestrator and the inference
    // gateway the administration one; only the orchestrator (which issues
    // episode tickets) and the inference gateway (which checks them) the ticket key.
    for (binary, env, _) in deployments(&defaults) {
        let holds = |name: &str| env.iter().any(|e| e == name);
        let publish = matches!(binary.as_str(), "learner" | "policy-server");
        let admin = matches!(binary.as_str(), "tool-gateway" | "rollout-orchestrator" | "inference-gateway");
        let tickets = matches!(binary.as_str(), "rollout-orchestrator" | "inference-gateway");
        assert_eq!(holds("SLEUTH_PUBLISH_TOKEN_FILE"), publish, "{binary} and the publication token");
        assert_eq!(holds("SLEUTH_ADMIN_TOKEN_FILE"), admin, "{binary} and the administration token");
        assert_eq!(holds("SLEUTH_TICKET_KEY_FILE"), tickets, "{binary} and the ticket key");
    }
    let unscoped = helm_template(&["auth.scopes=false"])?;
    validate(&unscoped)?;
    assert!(!unscoped.contains("SLEUTH_PUBLISH_TOKEN_FILE") && !unscoped.contains("SLEUTH_ADMIN_TOKEN_FILE"));
    assert!(production.contains("secretName: mesh-token"));
    assert!(!production.contains("kind: Secret"), "an existing secret must not be replaced");
    assert!(
        defaults.contains("secretName: ci-release-auth"),
        "the hook's Secret (chart_install.rs) when none is given"
    );
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
/// ready) as the rendezvous, with NCCL's settings and a memory /dev/shm;
/// only learner pods may reach a rank beyond its gRPC port (c10d's store and
/// connections have no authentication), even with NetworkPolicies off
/// elsewhere. A single learner sets no rank variables and no policy.
#[test]
fn a_multi_rank_learner_is_a_statefulset_whose_pods_know_their_rank() -> Result<()> {
    let manifests = helm_template(&[
        "components.learner.replicas=3",
        "components.learner.collectivePort=29501",
        "components.learner.checkpointUri=s3://checkpoints/runs",
        "components.learner.ncclEnv.NCCL_SOCKET_IFNAME=eth0",
        "database.existingSecret=postgres-url",
    ])?;
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
    assert_eq!(env("NCCL_SOCKET_IFNAME").as_deref(), Some("value: \"eth0\""));
    assert!(learner.contains("mountPath: /dev/shm") && learner.contains("medium: Memory"), "{learner}");
    let policies: Vec<&&str> = docs.iter().filter(|d| d.contains("\nkind: NetworkPolicy\n")).collect();
    assert_eq!(policies.len(), 1, "only the learner's policy without networkPolicy.enabled");
    let (_, ranks_rule) = policies[0].split_once("learner pods only.").context("the ranks' rule")?;
    assert!(
        ranks_rule.contains("app.kubernetes.io/component: learner") && !ranks_rule.contains("port:"),
        "learner pods, and only they, reach every port of a rank:\n{}",
        policies[0]
    );
    let ranks = docs
        .iter()
        .find(|d| d.contains("\nkind: Service") && d.contains("name: ci-release-learner-ranks\n"))
        .context("the ranks' headless Service")?;
    for line in ["clusterIP: None", "publishNotReadyAddresses: true", "port: 29501"] {
        assert!(ranks.lines().any(|l| l.trim() == line), "{line:?} missing from\n{ranks}");
    }

    let single = helm_template(&[])?;
    assert!(!single.contains("name: RANK"), "one learner needs no rendezvous");
    assert!(!single.contains("\nkind: NetworkPolicy\n") && !single.contains("/dev/shm"));
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

/// By default the orchestrator, the agents, the inference gateway and the
/// learner follow the ready pods of the agents, the gateways and the policy
/// servers through their EndpointSlices, holding the API token of the
/// release's ServiceAccount, whose discovery Role can only read
/// endpointslices; with discovery off, each gets one Service address and no
/// pod holds an API token.
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
        ("agent", "SLEUTH_TOOL_GATEWAY", "kube://ci-release-tool-gateway:grpc"),
        ("agent", "SLEUTH_INFERENCE_GATEWAY", "kube://ci-release-inference-gateway:grpc"),
    ] {
        let doc = workload(binary)?;
        assert_eq!(env(doc, name), Some(format!("value: \"{value}\"")), "{binary}");
        assert!(doc.contains("automountServiceAccountToken: true\n"), "{binary} holds the account's API token");
    }
    for binary in ["tool-gateway", "policy-server"] {
        assert!(workload(binary)?.contains("automountServiceAccountToken: false\n"), "{binary} needs no API access");
    }
    let role = document(&docs, "Role", "ci-release-discovery")?;
    assert_eq!(role.matches("apiGroups:").count(), 1, "one rule:\n{role}");
    for line in [
        r#"- apiGroups: ["discovery.k8s.io"]"#,
        r#"resources: ["endpointslices"]"#,
        r#"verbs: ["get", "list", "watch"]"#,
    ] {
        assert!(role.lines().any(|l| l.trim() == line), "{line} missing from\n{role}");
    }
    let binding = document(&docs, "RoleBinding", "ci-release-discovery")?;
    assert!(binding.contains("kind: ServiceAccount"));
    assert!(binding.contains("    name: ci-release\n"), "bound to the release's account:\n{binding}");

    let fixed = helm_template(&["discovery.kubernetes=false"])?;
    validate(&fixed)?;
    let docs: Vec<&str> = fixed.split("\n---").collect();
    let orchestrator = docs
        .iter()
        .find(|d| d.contains("command: [\"/usr/local/bin/rollout-orchestrator\"]"))
        .context("the orchestrator")?;
    assert_eq!(env(orchestrator, "SLEUTH_AGENT_WORKERS").as_deref(), Some("value: \"ci-release-agent:50052\""));
    assert!(!fixed.contains("ci-release-discovery"), "no discovery Role without discovery");
    assert!(!fixed.contains("automountServiceAccountToken: true"), "no pod holds an API token without discovery");
    Ok(())
}

/// The init container's command of a workload, as arguments.
fn init_command(doc: &str) -> Result<Vec<String>> {
    let line = doc
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("command: [\"/usr/local/bin/sleuth\""))
        .context("no model init container")?;
    let list = line.strip_prefix("command: ").context("command")?;
    Ok(serde_json::from_str(list)?)
}

/// Runs a rendered init container's `sleuth model fetch` here, with the
/// image's paths mapped to this machine's (`/usr/local/bin/sleuth` to the
/// built binary, `/models` to `models`, the image's GGUF to the venv's).
fn run_init_container(command: &[String], models: &std::path::Path, env: &[(&str, &str)]) -> Result<String> {
    let gguf = sleuth_testkit::smollm2_gguf()?;
    let args: Vec<String> = command[1..]
        .iter()
        .map(|arg| match arg.as_str() {
            "/opt/sleuth/models/SmolLM2-135M-Instruct.Q4_1.gguf" => gguf.display().to_string(),
            "/models/policy" => models.join("policy").display().to_string(),
            _ => arg.clone(),
        })
        .collect();
    let output = Command::new(sleuth_tests::binary("sleuth")?).args(&args).envs(env.iter().copied()).output()?;
    let log = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    ensure!(output.status.success(), "{command:?} failed:\n{log}");
    Ok(log)
}

/// A default install comes up on its own: every pod that loads the policy
/// gets it from an init container (tested here by running the rendered
/// command: it imports the GGUF the image ships, and a restart finds it
/// there), the orchestrator and the learner keep their state on volumes
/// that outlive the release, and every pod runs as a numeric non-root user
/// with a read-only root filesystem.
#[test]
fn a_default_install_provisions_the_model_and_keeps_state_on_volumes() -> Result<()> {
    let manifests = helm_template(&[])?;
    validate(&manifests)?;
    let docs = documents(&manifests);
    for binary in ["inference-gateway", "policy-server", "learner"] {
        let kind = if binary == "learner" { "StatefulSet" } else { "Deployment" };
        let doc = document(&docs, kind, &format!("ci-release-{binary}"))?;
        assert_eq!(env_line(doc, "SLEUTH_MODEL").as_deref(), Some("value: /models/policy"), "{binary}");
        assert!(init_command(doc).is_ok(), "{binary} provisions the model");
    }
    let orchestrator = document(&docs, "Deployment", "ci-release-rollout-orchestrator")?;
    assert!(
        init_command(orchestrator).is_err() && !orchestrator.contains("SLEUTH_MODEL"),
        "the dashboard's tokenizer is opt-in"
    );

    let policy = document(&docs, "Deployment", "ci-release-policy-server")?;
    let command = init_command(policy)?;
    let pod = tempfile::tempdir()?;
    let models = pod.path().join("models");
    let first = run_init_container(&command, &models, &[])?;
    assert!(first.contains("imported llama"), "{first}");
    for file in ["config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"] {
        assert!(models.join("policy").join(file).is_file(), "{file} provisioned");
    }
    let again = run_init_container(&command, &models, &[])?;
    assert!(again.contains("already holds the model"), "a restarted init container keeps the model: {again}");

    // State that must survive restarts lives on claims the release keeps.
    for (binary, kind, size, database) in [
        ("rollout-orchestrator", "Deployment", "1Gi", "sqlite:///var/lib/sleuth/rollout-orchestrator.db"),
        ("learner", "StatefulSet", "50Gi", "sqlite:///var/lib/sleuth/learner.db"),
    ] {
        let claim = document(&docs, "PersistentVolumeClaim", &format!("ci-release-{binary}-data"))?;
        assert!(has_line(claim, &format!("storage: {size}")) && has_line(claim, "helm.sh/resource-policy: keep"));
        let doc = document(&docs, kind, &format!("ci-release-{binary}"))?;
        assert!(has_line(doc, &format!("claimName: ci-release-{binary}-data")), "{binary} mounts its claim");
        assert_eq!(env_line(doc, "SLEUTH_DATABASE_URL"), Some(format!("value: \"{database}\"")));
    }
    assert!(has_line(orchestrator, "type: Recreate"), "one orchestrator holds the ReadWriteOnce claim at a time");
    let learner = document(&docs, "StatefulSet", "ci-release-learner")?;
    assert_eq!(env_line(learner, "SLEUTH_CHECKPOINT_URI").as_deref(), Some("value: \"/var/lib/sleuth/checkpoints\""));

    for doc in docs.iter().filter(|d| d.contains("\nkind: Deployment\n") || d.contains("\nkind: StatefulSet\n")) {
        for line in [
            "runAsNonRoot: true",
            "runAsUser: 10001",
            "readOnlyRootFilesystem: true",
            "allowPrivilegeEscalation: false",
        ] {
            assert!(has_line(doc, line), "{line:?} missing from\n{doc}");
        }
        let slim = ["rollout-orchestrator", "agent", "inference-gateway"]
            .iter()
            .any(|b| doc.contains(&format!("command: [\"/usr/local/bin/{b}\"]")));
        let image = if slim { "image: \"sleuth-slim:0.1.0\"" } else { "image: \"sleuth:0.1.0\"" };
        assert!(has_line(doc, image), "{image} expected in\n{doc}");
    }
    // The slim image has no libtorch: what runs from it must not load it.
    for binary in ["rollout-orchestrator", "agent", "inference-gateway", "sleuth"] {
        let ldd = Command::new("ldd").arg(sleuth_tests::binary(binary)?).output()?;
        let libraries = String::from_utf8(ldd.stdout)?;
        assert!(ldd.status.success() && !libraries.contains("libtorch"), "{binary} links libtorch:\n{libraries}");
    }
    Ok(())
}

/// A model on S3 is fetched by the init container with the credentials of
/// s3.existingSecret (tested against a real S3 API server), and the
/// services that reach S3 get its endpoint and credentials.
#[test]
fn a_model_on_s3_is_fetched_with_the_credentials_secret() -> Result<()> {
    let s3_server = sleuth_testkit::s3()?;
    let endpoint = sleuth_testkit::s3_endpoint(&s3_server);
    let manifests = helm_template(&[
        "model.source=s3://models/smollm2",
        &format!("s3.endpoint={endpoint}"),
        "s3.existingSecret=s3-credentials",
    ])?;
    validate(&manifests)?;
    let docs = documents(&manifests);
    let gateway = document(&docs, "Deployment", "ci-release-inference-gateway")?;
    assert!(
        gateway.contains("secretRef:\n                name: s3-credentials"),
        "the init container gets the credentials"
    );
    for binary in ["policy-server", "tool-gateway"] {
        let doc = document(&docs, "Deployment", &format!("ci-release-{binary}"))?;
        assert_eq!(env_line(doc, "SLEUTH_S3_ENDPOINT"), Some(format!("value: \"{endpoint}\"")), "{binary}");
    }
    assert!(env_line(gateway, "SLEUTH_S3_ENDPOINT").is_none(), "the inference gateway does not reach S3");

    let credentials = [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")];
    for (key, value) in credentials {
        // SAFETY: nextest runs each test in its own process; nothing else reads the environment concurrently.
        unsafe { std::env::set_var(key, value) };
    }
    // The model to upload: the GGUF imported in bf16, as values-l40s.yaml
    // has it (half the bytes of f32 to send through the test's S3 server).
    let scratch = tempfile::tempdir()?;
    let model = scratch.path().join("bf16");
    let gguf = sleuth_testkit::smollm2_gguf()?;
    let import = Command::new(sleuth_tests::binary("sleuth")?)
        .args(["model", "fetch", &gguf.display().to_string(), &model.display().to_string(), "--dtype", "bf16"])
        .output()?;
    ensure!(import.status.success(), "bf16 import: {}", String::from_utf8_lossy(&import.stderr));
    let s3 = sleuth_store::S3Args { s3_endpoint: Some(endpoint.clone()), ..Default::default() };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        if let sleuth_store::ObjectStore::S3 { client, .. } = sleuth_store::ObjectStore::open("s3://models", &s3)? {
            client.create_bucket().bucket("models").send().await?;
        }
        let store = sleuth_store::ObjectStore::open("s3://models/smollm2", &s3)?;
        for entry in std::fs::read_dir(&model)? {
            let path = entry?.path();
            if path.is_file() {
                store.put(&path.file_name().unwrap().to_string_lossy(), std::fs::read(&path)?).await?;
            }
        }
        anyhow::Ok(())
    })?;
    let pod = tempfile::tempdir()?;
    let log = run_init_container(&init_command(gateway)?, &pod.path().join("models"), &credentials)?;
    assert!(log.contains("fetched s3://models/smollm2"), "{log}");
    let fetched = pod.path().join("models/policy");
    assert_eq!(
        std::fs::read(fetched.join("config.json"))?,
        std::fs::read(model.join("config.json"))?,
        "the model arrives unchanged"
    );
    Ok(())
}

/// Scaling: agents and the tool gateway can get a CPU autoscaler, KEDA can
/// scale agents on the episodes they run, workloads with more than one pod
/// get a PodDisruptionBudget, and GPU pods are replaced without a spare GPU.
#[test]
fn workers_autoscale_and_gpu_pods_roll_without_a_spare_gpu() -> Result<()> {
    let manifests = helm_template(&[
        "components.agent.autoscaling.enabled=true",
        "components.agent.resources.requests.cpu=500m",
        "components.toolGateway.replicas=2",
    ])?;
    validate(&manifests)?;
    let docs = documents(&manifests);
    let hpa = document(&docs, "HorizontalPodAutoscaler", "ci-release-agent")?;
    for line in ["name: ci-release-agent", "minReplicas: 2", "maxReplicas: 16", "averageUtilization: 70"] {
        assert!(has_line(hpa, line), "{line:?} missing from\n{hpa}");
    }
    let agent = document(&docs, "Deployment", "ci-release-agent")?;
    assert!(!agent.contains("\n  replicas:"), "the autoscaler owns the agents' replica count");
    for name in ["ci-release-agent", "ci-release-tool-gateway"] {
        let budget = document(&docs, "PodDisruptionBudget", name)?;
        assert!(has_line(budget, "maxUnavailable: 1"), "{budget}");
    }
    assert!(
        document(&docs, "PodDisruptionBudget", "ci-release-rollout-orchestrator").is_err(),
        "a singleton's budget would block drains"
    );

    let keda = helm_template(&["keda.enabled=true", "keda.episodesPerAgent=4"])?;
    validate(&keda)?;
    let docs = documents(&keda);
    let scaled = document(&docs, "ScaledObject", "ci-release-agent")?;
    for line in [
        "apiVersion: keda.sh/v1alpha1",
        "type: prometheus",
        "threshold: \"4\"",
        r#"query: sum(sleuth_agent_episodes_in_flight{namespace="default",pod=~"ci-release-agent-.*"})"#,
    ] {
        assert!(has_line(scaled, line), "{line:?} missing from\n{scaled}");
    }
    assert!(!document(&docs, "Deployment", "ci-release-agent")?.contains("\n  replicas:"));

    let gpus = |replicas: &str| {
        helm_template(&[
            &format!("components.policyServer.replicas={replicas}"),
            "components.policyServer.resources.limits.nvidia\\.com/gpu=1",
        ])
    };
    let one = gpus("1")?;
    let policy = document(&documents(&one), "Deployment", "ci-release-policy-server")?.to_owned();
    assert!(has_line(&policy, "type: Recreate"), "{policy}");
    let two = gpus("2")?;
    let policy = document(&documents(&two), "Deployment", "ci-release-policy-server")?.to_owned();
    assert!(has_line(&policy, "maxSurge: 0") && has_line(&policy, "maxUnavailable: 1"), "{policy}");
    Ok(())
}

/// Values that cannot work are refused at install with what to change, and
/// per-component env, envFrom and extra volumes reach the container.
#[test]
fn impossible_values_are_refused_and_extras_reach_the_container() -> Result<()> {
    for (sets, named) in [
        (&["components.learner.replicas=2"][..], "set checkpointUri to s3://"),
        (
            &["components.learner.replicas=2", "components.learner.checkpointUri=s3://c/runs"][..],
            "database.existingSecret",
        ),
        (&["components.rolloutOrchestrator.replicas=2"][..], "run one"),
        (&["keda.enabled=true", "components.agent.autoscaling.enabled=true"][..], "enable one of them"),
        (&["components.toolGateway.autoscaling.enabled=true"][..], "components.toolGateway.resources.requests.cpu"),
        (&["redis.url=redis://:secret@redis:6379/0"][..], "/redis/url"),
        (&["podSecurityContext.runAsUser=sleuth"][..], "/podSecurityContext/runAsUser"),
        (&["model.source=models/policy"][..], "/model/source"),
    ] {
        let error = helm_template(sets).err().with_context(|| format!("{sets:?} was accepted"))?.to_string();
        assert!(error.contains(named), "{sets:?}: {error}");
    }
    let manifests = helm_template(&[
        "redis.existingSecret=redis-url",
        "components.toolGateway.env[0].name=SLEUTH_EMBEDDING_MODEL",
        "components.toolGateway.env[0].value=/embedder",
        "components.toolGateway.envFrom[0].configMapRef.name=tuning",
        "components.toolGateway.extraVolumes[0].name=embedder",
        "components.toolGateway.extraVolumes[0].persistentVolumeClaim.claimName=embedders",
        "components.toolGateway.extraVolumeMounts[0].name=embedder",
        "components.toolGateway.extraVolumeMounts[0].mountPath=/embedder",
    ])?;
    validate(&manifests)?;
    let docs = documents(&manifests);
    let gateway = document(&docs, "Deployment", "ci-release-tool-gateway")?;
    assert_eq!(env_line(gateway, "SLEUTH_EMBEDDING_MODEL").as_deref(), Some("value: /embedder"));
    for line in ["name: tuning", "claimName: embedders", "mountPath: /embedder"] {
        assert!(has_line(gateway, line), "{line:?} missing from\n{gateway}");
    }
    let orchestrator = document(&docs, "Deployment", "ci-release-rollout-orchestrator")?;
    let at = orchestrator.find("- name: SLEUTH_REDIS_URL\n").context("SLEUTH_REDIS_URL")?;
    let redis: Vec<&str> = orchestrator[at..].lines().skip(1).take(4).map(str::trim).collect();
    assert_eq!(
        redis,
        ["valueFrom:", "secretKeyRef:", "name: redis-url", "key: url"],
        "the Redis URL comes from the Secret"
    );
    Ok(())
}

/// With `tls.enabled` every pod mounts the certificate Secret, is told where
/// it is, and is probed by its own client (kubelet's gRPC probe cannot speak
/// TLS); the probe's command is one the `sleuth` binary accepts.
#[test]
fn mutual_tls_mounts_the_certificates_and_probes_through_the_pods_own_client() -> Result<()> {
    let error = helm_template(&["tls.enabled=true"]).err().context("tls without a Secret was accepted")?;
    assert!(error.to_string().contains("tls.secretName"), "{error}");
    let manifests = helm_template(&["tls.enabled=true", "tls.secretName=mesh-tls"])?;
    validate(&manifests)?;
    let docs = documents(&manifests);
    for (binary, env, probe) in deployments(&manifests) {
        let help = String::from_utf8(Command::new(sleuth_tests::binary(&binary)?).arg("--help").output()?.stdout)?;
        for name in ["SLEUTH_TLS_CERT", "SLEUTH_TLS_KEY", "SLEUTH_TLS_CA", "SLEUTH_TLS_SERVER_NAME"] {
            assert!(env.iter().any(|e| e == name), "{binary} lacks {name}");
            assert!(help.contains(&format!("env: {name}")), "{binary} does not read {name}");
        }
        assert_eq!(probe, None, "{binary} keeps kubelet's gRPC probe, which cannot speak TLS");
        let kind = if binary == "learner" { "StatefulSet" } else { "Deployment" };
        let doc = document(&docs, kind, &format!("ci-release-{binary}"))?;
        for line in ["secretName: mesh-tls", "mountPath: /etc/sleuth/tls", "value: \"sleuth-mesh\""] {
            assert!(has_line(doc, line), "{binary}: {line:?} missing");
        }
        // The probe's own command, run here against a port nobody serves:
        // it must parse (exit 1, not sleuth's usage error 2) and check only this service.
        let command = doc
            .lines()
            .skip_while(|l| !l.contains("readinessProbe:"))
            .find_map(|l| l.trim().strip_prefix("command: ["))
            .context("an exec probe")?;
        let mut args: Vec<String> = doc[doc.find(command).unwrap_or(0)..]
            .split(']')
            .next()
            .unwrap_or_default()
            .split(',')
            .map(|a| a.trim().trim_matches('"').to_owned())
            .filter(|a| !a.is_empty())
            .collect();
        assert_eq!(args.remove(0), "/usr/local/bin/sleuth", "{command}");
        let port = args.last().cloned().unwrap_or_default();
        *args.last_mut().context("the probe's address")? = "127.0.0.1:9".to_owned();
        assert!(port.starts_with("127.0.0.1:"), "{binary} probes {port}");
        let output = Command::new(sleuth_tests::binary("sleuth")?).args(&args).output()?;
        let table = String::from_utf8_lossy(&output.stdout);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {}{table}", String::from_utf8_lossy(&output.stderr));
        assert_eq!(table.lines().filter(|l| l.contains("127.0.0.1:9")).count(), 1, "{table}");
    }
    Ok(())
}
