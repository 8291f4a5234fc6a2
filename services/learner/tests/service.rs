//! The learner as a service, with real Redis, SQLite and checkpoints on disk:
//! killed mid-run and resumed, it ends with exactly the parameters of an
//! uninterrupted run and leaves no group unacknowledged or counted twice;
//! each step's weights reach a policy server, whose outputs change.

mod support;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use prost::Message;
use sleuth_store::RedisStore;
use sleuth_store::trajectories::{GroupConsumer, publish};
use support::*;
use tch::Tensor;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_learner_resumes_to_the_uninterrupted_result() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (env, _redis_server) = Env::start(scratch.path())?;
    let redis = RedisStore::open(&env.redis_url)?;
    let entries = entries();

    // Uninterrupted.
    for entry in &entries {
        publish(&redis, "straight", entry).await?;
    }
    let straight_dir = scratch.path().join("straight");
    let mut child = learner(&env, "straight", &straight_dir)?;
    tokio::task::block_in_place(|| wait_exit(&mut child, Duration::from_secs(120)))?;

    // Killed after step 3 (checkpoint at 2), resumed once the rest arrives.
    let first_three = 3 * BATCH + 2; // + the corrupt and the flat entries
    for entry in &entries[..first_three] {
        publish(&redis, "crashed", entry).await?;
    }
    let crashed_dir = scratch.path().join("crashed");
    let mut child = learner(&env, "crashed", &crashed_dir)?;
    until_step(&env, "crashed", 3, &mut child).await?;
    child.kill()?; // SIGKILL: no chance to checkpoint or acknowledge
    child.wait()?;
    let consumer = GroupConsumer::open(redis.clone(), "crashed", "inspector").await?;
    let (pending, _) = consumer.backlog().await?;
    assert_eq!(pending, 2, "step 3's two groups were delivered but not acknowledged at the crash");
    assert!(crashed_dir.join("step-00000002/COMPLETE").is_file());
    assert!(!crashed_dir.join("step-00000004").exists());

    for entry in &entries[first_three..] {
        publish(&redis, "crashed", entry).await?;
    }
    let mut child = learner(&env, "crashed", &crashed_dir)?;
    tokio::task::block_in_place(|| wait_exit(&mut child, Duration::from_secs(120)))?;

    let (straight, crashed) = (final_params(&straight_dir)?, final_params(&crashed_dir)?);
    assert_eq!(straight.len(), crashed.len());
    let initial = Tensor::read_safetensors(env.model.join("model.safetensors"))?;
    let mut moved = 0f64;
    for ((name, a), (other, b)) in straight.iter().zip(&crashed) {
        assert_eq!(name, other);
        let diff = (a - b).abs().max().double_value(&[]);
        assert_eq!(diff, 0.0, "{name} differs by {diff} between the resumed and the uninterrupted run");
        let start = &initial.iter().find(|(n, _)| n == name).context("initial tensor")?.1;
        moved = moved.max((a - start).abs().max().double_value(&[]));
    }
    assert!(moved > 1e-3, "training changed the weights");

    // Nothing left unacknowledged, every group counted once.
    let (pending, lag) = consumer.backlog().await?;
    assert_eq!((pending, lag), (0, 0));
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(crashed_dir.join(format!("step-{STEPS:08}/meta.json")))?)?;
    assert_eq!(meta["groups_consumed"], 12);
    assert_eq!(meta["groups_rejected"], 1);
    assert_eq!(meta["groups_filtered"], 1);
    assert_eq!(recorded_steps(&env.database, "crashed").await?, (1..=STEPS).collect::<Vec<_>>());
    Ok(())
}

/// A checkpoint damaged after it was sealed (one flipped byte: the file still
/// parses; only its recorded digest tells) is passed over for the one before,
/// whose later groups are trained again; checkpoints older than the newest
/// kept are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_checkpoint_falls_back_to_the_one_before_and_old_ones_are_pruned() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (env, _redis_server) = Env::start(scratch.path())?;
    let redis = RedisStore::open(&env.redis_url)?;
    for entry in entries() {
        publish(&redis, "damaged", &entry).await?;
    }
    let dir = scratch.path().join("damaged");
    let keeping_two = || -> Result<Child> {
        Ok(learner_command(&env, "damaged", &dir, STEPS)?.env("SLEUTH_KEEP_CHECKPOINTS", "2").spawn()?)
    };
    tokio::task::block_in_place(|| wait_exit(&mut keeping_two()?, Duration::from_secs(120)))?;
    let on_disk = || -> Result<Vec<String>> {
        let mut names: Vec<String> = std::fs::read_dir(&dir)?
            .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_>>()?;
        names.sort();
        Ok(names)
    };
    assert_eq!(on_disk()?, ["step-00000004", "step-00000006"], "checkpoints at 2, 4 and 6; the newest 2 kept");

    let shard = dir.join("step-00000006/rank-0-of-1.safetensors");
    let mut bytes = std::fs::read(&shard)?;
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&shard, bytes)?;
    // Steps 5 and 6 again, from fresh groups: their first groups were
    // acknowledged when the damaged checkpoint was sealed.
    for index in 0..2 * BATCH {
        publish(&redis, "damaged", &group(100 + index, false).encode_to_vec()).await?;
    }
    tokio::task::block_in_place(|| wait_exit(&mut keeping_two()?, Duration::from_secs(120)))?;

    let meta: learner::checkpoint::Meta = serde_json::from_slice(&std::fs::read(dir.join("step-00000006/meta.json"))?)?;
    assert_eq!(meta.shard_sha256, [learner::checkpoint::digest(&std::fs::read(&shard)?)], "step 6 sealed again");
    assert_eq!(meta.groups_consumed, 12, "8 groups up to step 4, then the 4 fresh ones");
    let consumer = GroupConsumer::open(redis.clone(), "damaged", "inspector").await?;
    assert_eq!(consumer.backlog().await?, (0, 0));
    assert_eq!(recorded_steps(&env.database, "damaged").await?, (1..=STEPS).collect::<Vec<_>>());
    assert_eq!(on_disk()?, ["step-00000004", "step-00000006"]);
    Ok(())
}

/// Groups read ahead of the step being formed are not in its checkpoint:
/// they stay unacknowledged and are trained after a restart (acknowledging
/// every entry read at checkpoint time lost them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_ahead_groups_are_not_acknowledged_by_a_checkpoint() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (env, _redis_server) = Env::start(scratch.path())?;
    let redis = RedisStore::open(&env.redis_url)?;
    // The learner reads two entries at a time: [flat, g0], then [g1, g2].
    // Step 1 trains g0 and g1; g2 is read ahead when step 1 checkpoints.
    for entry in [group(99, true), group(0, false), group(1, false), group(2, false)] {
        publish(&redis, "ahead", &entry.encode_to_vec()).await?;
    }
    let checkpoints = scratch.path().join("ahead");
    let mut child = learner_until(&env, "ahead", &checkpoints, 1)?;
    tokio::task::block_in_place(|| wait_exit(&mut child, Duration::from_secs(120)))?;
    let consumer = GroupConsumer::open(redis.clone(), "ahead", "inspector").await?;
    assert_eq!(consumer.backlog().await?.0, 1, "g2 was read ahead, never trained: it must stay pending");

    publish(&redis, "ahead", &group(3, false).encode_to_vec()).await?;
    let mut child = learner_until(&env, "ahead", &checkpoints, 2)?;
    tokio::task::block_in_place(|| wait_exit(&mut child, Duration::from_secs(120)))?;
    assert_eq!(consumer.backlog().await?, (0, 0));
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(checkpoints.join("step-00000002/meta.json"))?)?;
    assert_eq!((meta["groups_consumed"].as_u64(), meta["groups_filtered"].as_u64()), (Some(4), Some(1)));
    Ok(())
}

/// A greedy request whose model logprobs show which weights the server serves.
fn greedy(max_new_tokens: u32) -> sleuth_proto::policy::v1::GenerateRequest {
    sleuth_proto::policy::v1::GenerateRequest {
        prompt_token_ids: vec![1, 2, 3, 4],
        return_model_logprobs: true,
        sampling: Some(sleuth_proto::common::v1::SamplingParams {
            temperature: Some(0.0),
            max_new_tokens,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Command line of an in-process learner on `run` training steps of 2
/// groups (on the CPU, in f32), with `extra` flags after it.
fn learner_args<'a>(
    run: &'a str,
    model: &'a str,
    redis_url: &'a str,
    database: &'a str,
    checkpoint_uri: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "learner",
        "--insecure",
        "--listen",
        "127.0.0.1:0",
        "--run-id",
        run,
        "--device",
        "cpu",
        "--dtype",
        "f32",
        "--model",
        model,
        "--redis-url",
        redis_url,
        "--database-url",
        database,
        "--checkpoint-uri",
        checkpoint_uri,
        "--global-batch-size",
        "2",
    ];
    args.extend_from_slice(extra);
    args
}

/// Runs an in-process learner for one step of 2 groups on `run`, then returns.
async fn train_one_step(
    run: &str,
    model: &str,
    redis_url: &str,
    database: &str,
    checkpoint_uri: &str,
    extra: &[&str],
) -> Result<()> {
    let one_step = [&["--max-steps", "1", "--learning-rate", "0.05"], extra].concat();
    let args = learner_args(run, model, redis_url, database, checkpoint_uri, &one_step);
    let config = <learner::Config as clap::Parser>::try_parse_from(args)?;
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    tokio::time::timeout(Duration::from_secs(120), learner::run(config, listener, std::future::pending())).await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_weights_change_the_policy_server() -> Result<()> {
    use sleuth_proto::policy::v1::GetModelInfoRequest;
    use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;

    let scratch = tempfile::tempdir()?;
    let model = scratch.path().join("model");
    tiny_model(&model)?;
    let model = model.to_str().context("utf-8")?.to_owned();
    let redis_server = sleuth_testkit::redis()?;
    let redis_url = sleuth_testkit::redis_url(&redis_server);
    // Publication has its own token: the mesh token opens turns, not UpdateWeights.
    let tokens = ["--auth-token", "mesh-secret", "--publish-token", "publish-secret"];
    let (policy_addr, _policy) =
        sleuth_testkit::start_service!(policy_server, sleuth_testkit::service::policy_server_args(&model, &tokens));
    sleuth_testkit::service::wait_serving(&policy_addr, "sleuth.policy.v1.PolicyServer").await?;
    let mesh: sleuth_kit::BearerToken = "mesh-secret".parse()?;
    let mut policy =
        PolicyServerClient::new(sleuth_kit::client::connect(&policy_addr, Some(&mesh), Duration::from_secs(5)).await?);
    let header = sleuth_proto::policy::v1::UpdateWeightsRequest {
        part: Some(sleuth_proto::policy::v1::update_weights_request::Part::Header(
            sleuth_proto::policy::v1::WeightsHeader { version: 9, checkpoint_uri: model.clone(), ..Default::default() },
        )),
    };
    let denied = policy.update_weights(tokio_stream::iter([header])).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
    let greedy = greedy(12);
    let before = policy.generate(greedy.clone()).await?.into_inner();
    assert_eq!(before.policy_versions.first(), Some(&0));

    let redis = RedisStore::open(&redis_url)?;
    for i in 0..2 {
        publish(&redis, "publish", &group(i, false).encode_to_vec()).await?;
    }
    let checkpoints = scratch.path().join("checkpoints");
    let database = format!("sqlite://{}", scratch.path().join("runs.db").display());
    let checkpoint_uri = checkpoints.to_str().context("utf-8")?;
    let learner_flags = [&["--policy-servers", policy_addr.as_str()][..], &tokens].concat();
    train_one_step("publish", &model, &redis_url, &database, checkpoint_uri, &learner_flags).await?;

    let info = policy.get_model_info(GetModelInfoRequest {}).await?.into_inner();
    assert_eq!(info.policy_version, 1, "the server serves the learner's step-1 weights");
    let recorded = learner::records::steps(&sleuth_store::Database::open(&database)?, "publish").await?;
    assert_eq!(recorded[0].1["publish_bytes"], info.num_parameters * 4, "an f32 server gets f32");
    let after = policy.generate(greedy).await?.into_inner();
    assert_eq!(after.policy_versions.first(), Some(&1));
    assert_ne!(after.model_logprobs, before.model_logprobs, "new weights, new distribution");
    assert_eq!(sleuth_store::trajectories::learner_version(&redis, "publish").await?, 1);
    assert!(checkpoints.join("publish/step-00000001/hf/config.json").is_file());
    Ok(())
}

/// A policy server serving bf16 gets the learner's weights in bf16: half
/// the bytes of f32, and the step's weights as the server rounds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bf16_policy_server_gets_weights_in_bf16() -> Result<()> {
    use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;
    use sleuth_proto::policy::v1::{DType, GetModelInfoRequest};

    let scratch = tempfile::tempdir()?;
    let model = scratch.path().join("model");
    tiny_model(&model)?;
    let model = model.to_str().context("utf-8")?.to_owned();
    let redis_server = sleuth_testkit::redis()?;
    let redis_url = sleuth_testkit::redis_url(&redis_server);
    let mut args = sleuth_testkit::service::policy_server_args(&model, &[]);
    let at = args.iter().position(|a| a == "--dtype").context("the server's --dtype")?;
    args[at + 1] = "bf16".into();
    let (policy_addr, _policy) = sleuth_testkit::start_service!(policy_server, args);
    sleuth_testkit::service::wait_serving(&policy_addr, "sleuth.policy.v1.PolicyServer").await?;
    let redis = RedisStore::open(&redis_url)?;
    for i in 0..2 {
        publish(&redis, "bf16", &group(i, false).encode_to_vec()).await?;
    }
    let database = format!("sqlite://{}", scratch.path().join("runs.db").display());
    let checkpoints = scratch.path().join("checkpoints");
    let flags = ["--policy-servers", policy_addr.as_str()];
    train_one_step("bf16", &model, &redis_url, &database, checkpoints.to_str().context("utf-8")?, &flags).await?;

    let mut policy =
        PolicyServerClient::new(sleuth_kit::client::connect(&policy_addr, None, Duration::from_secs(5)).await?);
    let info = policy.get_model_info(GetModelInfoRequest {}).await?.into_inner();
    assert_eq!((info.dtype(), info.policy_version), (DType::DtypeBf16, 1));
    let recorded = learner::records::steps(&sleuth_store::Database::open(&database)?, "bf16").await?;
    assert_eq!(recorded[0].1["publish_bytes"], info.num_parameters * 2, "bf16 on the wire");
    Ok(())
}

/// Two runs one after the other on the same policy server, as a recipe's
/// SFT then GRPO: the second run has no start model of its own, yet the
/// server holds the first run's weights, so it publishes the learner's
/// model as its own version 1 (the server takes it, though it served the
/// first run's version 1: versions count each run's own steps), and its
/// turns are never sampled by the first run's weights. `max_steps` (like
/// the learning-rate schedule) counts its optimizer steps, not version
/// numbers, so it trains both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_after_another_on_the_same_servers_trains_its_own_steps() -> Result<()> {
    use sleuth_proto::policy::v1::GetModelInfoRequest;
    use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;

    let scratch = tempfile::tempdir()?;
    let (env, _redis_server) = Env::start(scratch.path())?;
    let (model, redis_url, database) = (env.model.to_str().context("utf-8")?, &env.redis_url, &env.database);
    let (policy_addr, _policy) =
        sleuth_testkit::start_service!(policy_server, sleuth_testkit::service::policy_server_args(model, &[]));
    sleuth_testkit::service::wait_serving(&policy_addr, "sleuth.policy.v1.PolicyServer").await?;
    let mut policy =
        PolicyServerClient::new(sleuth_kit::client::connect(&policy_addr, None, Duration::from_secs(5)).await?);
    let redis = RedisStore::open(redis_url)?;
    for (run, groups) in [("first", 0..2), ("second", 2..6)] {
        for i in groups {
            publish(&redis, run, &group(i, false).encode_to_vec()).await?;
        }
    }
    let checkpoints = scratch.path().join("checkpoints");
    let checkpoints = checkpoints.to_str().context("utf-8")?;
    let servers = ["--policy-servers", policy_addr.as_str()];
    train_one_step("first", model, redis_url, database, checkpoints, &servers).await?;
    until_served(&policy_addr, 1, "the first run's step").await?;
    let second_turn = sleuth_proto::policy::v1::GenerateRequest { run_id: "second".into(), ..greedy(4) };
    let refused = policy.generate(second_turn.clone()).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "the first run's weights never sample the second's turns: {refused:?}"
    );

    // Its groups carry version 0 (made before any run): never stale here.
    let two_steps = [&servers[..], &["--max-steps", "2", "--max-staleness", "100"]].concat();
    let config = <learner::Config as clap::Parser>::try_parse_from(learner_args(
        "second",
        model,
        redis_url,
        database,
        checkpoints,
        &two_steps,
    ))?;
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    tokio::time::timeout(Duration::from_secs(120), learner::run(config, listener, std::future::pending())).await??;
    let db = sleuth_store::Database::open(database)?;
    let steps = learner::records::steps(&db, "second").await?;
    let trained: Vec<u64> = steps.iter().filter(|(_, m)| m["groups"] != 0).map(|(step, _)| *step).collect();
    assert_eq!(trained, vec![2, 3], "two steps trained above the start version 1: {steps:?}");
    assert_eq!(steps[0].0, 1, "{steps:?}");
    assert_eq!(steps[0].1["republished"], "start model", "{steps:?}");
    until_served(&policy_addr, 3, "the second run's last step").await?;
    let info = policy.get_model_info(GetModelInfoRequest {}).await?.into_inner();
    assert_eq!((info.run_id.as_str(), info.policy_version), ("second", 3), "the second run's last step is served");
    let served = policy.generate(second_turn).await?.into_inner();
    assert_eq!(served.policy_versions, vec![3; served.token_ids.len()]);
    Ok(())
}

/// Checkpoints to `s3://` (a real S3 API server), and the policy server
/// loading the learner's merged export straight from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_go_to_s3_and_the_policy_server_loads_them_from_there() -> Result<()> {
    use sleuth_proto::policy::v1 as policy_pb;
    use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;

    let scratch = tempfile::tempdir()?;
    let model = scratch.path().join("model");
    tiny_model(&model)?;
    let model = model.to_str().context("utf-8")?.to_owned();
    let s3_server = sleuth_testkit::s3()?;
    let endpoint = sleuth_testkit::s3_endpoint(&s3_server);
    // SAFETY: nextest runs each test in its own process; nothing else reads the environment concurrently.
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", "sleuth-test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "sleuth-test-secret");
    }
    let s3 = sleuth_store::S3Args { s3_endpoint: Some(endpoint.clone()), ..Default::default() };
    if let sleuth_store::ObjectStore::S3 { client, .. } = sleuth_store::ObjectStore::open("s3://runs", &s3)? {
        client.create_bucket().bucket("runs").send().await?;
    }
    let redis_server = sleuth_testkit::redis()?;
    let redis_url = sleuth_testkit::redis_url(&redis_server);
    let redis = RedisStore::open(&redis_url)?;
    for i in 0..2 {
        publish(&redis, "s3-run", &group(i, false).encode_to_vec()).await?;
    }
    let database = format!("sqlite://{}", scratch.path().join("runs.db").display());
    train_one_step("s3-run", &model, &redis_url, &database, "s3://runs", &["--s3-endpoint", &endpoint]).await?;
    let store = sleuth_store::ObjectStore::open("s3://runs/s3-run", &s3)?;
    let keys = store.list("").await?;
    for key in [
        "step-00000001/COMPLETE",
        "step-00000001/meta.json",
        "step-00000001/rank-0-of-1.safetensors",
        "step-00000001/hf/model.safetensors",
    ] {
        assert!(keys.iter().any(|k| k == key), "{key} missing from {keys:?}");
    }

    let (policy_addr, _policy) = sleuth_testkit::start_service!(
        policy_server,
        sleuth_testkit::service::policy_server_args(&model, &["--s3-endpoint", &endpoint])
    );
    sleuth_testkit::service::wait_serving(&policy_addr, "sleuth.policy.v1.PolicyServer").await?;
    let mut policy =
        PolicyServerClient::new(sleuth_kit::client::connect(&policy_addr, None, Duration::from_secs(5)).await?);
    let greedy = greedy(8);
    let before = policy.generate(greedy.clone()).await?.into_inner();
    let header = |uri: &str| policy_pb::UpdateWeightsRequest {
        part: Some(policy_pb::update_weights_request::Part::Header(policy_pb::WeightsHeader {
            version: 1,
            checkpoint_uri: uri.into(),
            ..Default::default()
        })),
    };
    let missing = policy.update_weights(tokio_stream::iter([header("s3://runs/nothing-here")])).await.unwrap_err();
    assert!(missing.message().contains("s3://runs/nothing-here"), "{missing:?}");
    let updated =
        policy.update_weights(tokio_stream::iter([header("s3://runs/s3-run/step-00000001/hf")])).await?.into_inner();
    assert_eq!(updated.version, 1);
    let after = policy.generate(greedy).await?.into_inner();
    assert_ne!(after.model_logprobs, before.model_logprobs, "the learner's step-1 weights are served");
    Ok(())
}

/// A policy server that missed a publication (down at the time, or restarted
/// onto its base weights as version 0) is brought to the learner's current
/// weights while the learner waits for groups, without a new step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_server_that_missed_a_version_gets_the_current_weights() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (env, _redis_server) = Env::start(scratch.path())?;
    let (model, redis_url, database) = (env.model.to_str().context("utf-8")?, &env.redis_url, &env.database);
    let redis = RedisStore::open(redis_url)?;
    for i in 0..2 {
        publish(&redis, "late", &group(i, false).encode_to_vec()).await?;
    }
    // Nothing listens on `late_addr` when step 1 is published.
    let late_addr = format!("127.0.0.1:{}", sleuth_testkit::free_port()?);
    let checkpoints = scratch.path().join("checkpoints");
    let checkpoints = checkpoints.to_str().context("utf-8")?;
    let args = learner_args("late", model, redis_url, database, checkpoints, &["--policy-servers", &late_addr]);
    let (_learner_addr, _learner) = sleuth_testkit::start_service!(learner, args);
    let deadline = Instant::now() + Duration::from_secs(60);
    while sleuth_store::trajectories::learner_version(&redis, "late").await? < 1 {
        ensure!(Instant::now() < deadline, "the learner never trained step 1");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let (policy_addr, _policy) = sleuth_testkit::start_service!(
        policy_server,
        ["policy-server", "--listen", &late_addr, "--device", "cpu", "--dtype", "f32", "--model", model]
    );
    sleuth_testkit::service::wait_serving(&policy_addr, "sleuth.policy.v1.PolicyServer").await?;
    until_served(&policy_addr, 1, "the late policy server").await?;
    Ok(())
}

/// One learner per run. A second learner for a run waits for the first's
/// lease, naming who holds it, and trains nothing. When the first freezes
/// past its lease (a stuck pod), the second takes over from the last
/// checkpoint and finishes the run; the first, woken, stops at its next act
/// instead of training on. Every group is trained once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_learner_waits_and_a_stuck_one_is_fenced_off() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (env, _redis_server) = Env::start(scratch.path())?;
    let redis = RedisStore::open(&env.redis_url)?;
    let entries = entries();
    let first_three = 3 * BATCH + 2; // + the corrupt and the flat entries
    for entry in &entries[..first_three] {
        publish(&redis, "fenced", entry).await?;
    }
    let dir = scratch.path().join("fenced");
    let log = |name: &str| scratch.path().join(name);
    let start = |name: &str| -> Result<Child> {
        let mut command = learner_command(&env, "fenced", &dir, STEPS)?;
        command.env("SLEUTH_LEASE_TTL", "2s").env("SLEUTH_LOG", "info").stderr(std::fs::File::create(log(name))?);
        Ok(command.spawn()?)
    };
    let read = |name: &str| std::fs::read_to_string(log(name)).unwrap_or_default();
    let wait_for = async |what: &str, done: &dyn Fn() -> bool| -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !done() {
            ensure!(
                Instant::now() < deadline,
                "{what} did not happen; first:\n{}\nsecond:\n{}",
                read("first"),
                read("second")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    };

    let mut first = start("first")?;
    until_step(&env, "fenced", 3, &mut first).await?;
    let mut second = start("second")?;
    let first_pid = format!("pid-{}", first.id());
    wait_for("the second learner waiting for the first", &|| {
        let second = read("second");
        second.contains("waiting for its lease") && second.contains(&first_pid)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(recorded_steps(&env.database, "fenced").await?, [1, 2, 3], "the second learner trains nothing");

    // The first freezes: its lease runs out and the second takes the run over.
    let signal = |name: &str, child: &Child| Command::new("kill").args([name, &child.id().to_string()]).status();
    ensure!(signal("-STOP", &first)?.success());
    wait_for("the second learner taking the lease", &|| read("second").contains("took the run's learner lease"))
        .await?;
    for entry in &entries[first_three..] {
        publish(&redis, "fenced", entry).await?;
    }
    tokio::task::block_in_place(|| wait_exit(&mut second, Duration::from_secs(120)))?;

    // Woken, the first finds the run gone from under it and stops.
    ensure!(signal("-CONT", &first)?.success());
    let status = tokio::task::block_in_place(|| -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = first.try_wait()? {
                return Ok(status);
            }
            ensure!(Instant::now() < deadline, "the woken learner did not stop:\n{}", read("first"));
            std::thread::sleep(Duration::from_millis(50));
        }
    })?;
    assert!(!status.success(), "a fenced-off learner fails");
    assert!(read("first").contains("lost"), "it says why:\n{}", read("first"));

    let consumer = GroupConsumer::open(redis.clone(), "fenced", "inspector").await?;
    assert_eq!(consumer.backlog().await?, (0, 0), "nothing left unacknowledged");
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(format!("step-{STEPS:08}/meta.json")))?)?;
    assert_eq!((meta["groups_consumed"].as_u64(), meta["groups_rejected"].as_u64()), (Some(12), Some(1)));
    assert_eq!(recorded_steps(&env.database, "fenced").await?, (1..=STEPS).collect::<Vec<_>>());
    Ok(())
}

/// Publication targets found through Kubernetes (a fake API server speaking
/// the real list and watch protocol): a policy-server pod that becomes ready
/// after the learner published version 1 is brought to it, with no restart;
/// one that stops being ready is left out of publication.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_pod_that_joins_through_kubernetes_gets_the_current_weights() -> Result<()> {
    use sleuth_testkit::kube_api::FakeKubeApi;

    let scratch = tempfile::tempdir()?;
    let (env, _redis_server) = Env::start(scratch.path())?;
    let redis = RedisStore::open(&env.redis_url)?;
    for i in 0..2 {
        publish(&redis, "joined", &group(i, false).encode_to_vec()).await?;
    }
    let api = FakeKubeApi::start().await?;
    let checkpoints = scratch.path().join("checkpoints").join("joined");
    let mut learner = learner_command(&env, "joined", &checkpoints, 0)?
        .env("SLEUTH_POLICY_SERVERS", "kube://policy:grpc")
        .env("KUBECONFIG", api.kubeconfig())
        .env("SLEUTH_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut stderr = learner.stderr.take().context("stderr")?;
    let log = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    until_step(&env, "joined", 1, &mut learner).await?;

    // A policy-server pod becomes ready: its endpoint appears in the Service's slice.
    let (policy_addr, _policy) = sleuth_testkit::start_service!(
        policy_server,
        sleuth_testkit::service::policy_server_args(env.model.to_str().context("utf-8")?, &[])
    );
    sleuth_testkit::service::wait_serving(&policy_addr, "sleuth.policy.v1.PolicyServer").await?;
    let port: u16 = policy_addr.rsplit(':').next().context("port")?.parse()?;
    api.set_slice("policy", "policy-a", "grpc", port, &[("127.0.0.1", true)]);
    until_served(&policy_addr, 1, "the joining policy pod").await?;
    let _ = learner.kill();
    let _ = learner.wait();
    let text = log.join().unwrap_or_default();
    assert!(text.contains("publication target joined"), "{text}");
    Ok(())
}

/// Waits up to 30 s until the policy server at `addr` serves `version`;
/// `who` names it in the error.
async fn until_served(addr: &str, version: u64, who: &str) -> Result<()> {
    use sleuth_proto::policy::v1::GetModelInfoRequest;
    use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;
    let mut policy = PolicyServerClient::new(sleuth_kit::client::connect(addr, None, Duration::from_secs(5)).await?);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let served = policy.get_model_info(GetModelInfoRequest {}).await?.into_inner().policy_version;
        if served == version {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "{who} still serves version {served}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
