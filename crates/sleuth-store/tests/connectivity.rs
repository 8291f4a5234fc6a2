//! The store clients against real servers started on loopback ports.

use anyhow::Result;
use sleuth_store::{Database, ObjectStore, RedisStore, S3Args, StoreError};

#[tokio::test]
async fn redis_round_trip_and_probe() -> Result<()> {
    let server = sleuth_testkit::redis()?;
    let store = RedisStore::connect(&sleuth_testkit::redis_url(&server)).await?;
    let mut connection = store.connection().await?;
    redis::cmd("SET").arg("episode:1").arg("trace").query_async::<()>(&mut connection).await?;
    let value: String = redis::cmd("GET").arg("episode:1").query_async(&mut connection).await?;
    assert_eq!(value, "trace");
    assert_eq!(store.probe().check().await, Ok(()));

    drop(server);
    let error = store.probe().check().await.unwrap_err();
    assert!(error.contains("redis"), "{error}");
    Ok(())
}

/// A run's published-group markers get a deadline when the run ends for
/// good; another run's keep theirs, and the stream itself stays.
#[tokio::test]
async fn a_finished_runs_markers_expire_and_no_other_key_does() -> Result<()> {
    use sleuth_store::trajectories::{expire_published, publish_once, published_key, stream_key};
    let server = sleuth_testkit::redis()?;
    let store = RedisStore::connect(&sleuth_testkit::redis_url(&server)).await?;
    for group in 0..2500 {
        publish_once(&store, "done", &format!("g{group}"), b"x").await?;
    }
    publish_once(&store, "done-later", "g0", b"x").await?;
    publish_once(&store, "other", "g0", b"x").await?;
    let expired = expire_published(&store, "done", std::time::Duration::from_secs(3600)).await?;
    assert_eq!(expired, 2500);
    let mut connection = store.connection().await?;
    for (key, expiring) in [
        (published_key("done", "g0"), true),
        (published_key("done", "g2499"), true),
        (published_key("done-later", "g0"), false),
        (published_key("other", "g0"), false),
        (stream_key("done"), false),
    ] {
        let seconds: i64 = redis::cmd("TTL").arg(&key).query_async(&mut connection).await?;
        assert_eq!(seconds > 0 && seconds <= 3600, expiring, "{key}: TTL {seconds}");
    }
    Ok(())
}

/// Redis without persistence (the testkit's default), or with an eviction
/// policy, is named setting by setting; Redis as production must run it
/// (every command synced, nothing evicted) has no problem.
#[tokio::test]
async fn redis_settings_that_can_lose_groups_are_named() -> Result<()> {
    let volatile = sleuth_testkit::redis()?;
    let store = RedisStore::connect(&sleuth_testkit::redis_url(&volatile)).await?;
    let mut connection = store.connection().await?;
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async::<()>(&mut connection)
        .await?;
    let problems = store.durability_problems().await?;
    assert!(problems.iter().any(|p| p == "appendonly is no, must be yes"), "{problems:?}");
    assert!(problems.iter().any(|p| p == "maxmemory-policy is allkeys-lru, must be noeviction"), "{problems:?}");

    let durable = sleuth_testkit::redis_persistent()?;
    let store = RedisStore::connect(&sleuth_testkit::redis_url(&durable)).await?;
    assert_eq!(store.durability_problems().await?, Vec::<String>::new());
    Ok(())
}

#[tokio::test]
async fn redis_unreachable_names_the_redacted_url() {
    let port = sleuth_testkit::free_port().unwrap();
    let error = RedisStore::connect(&format!("redis://:hunter2@127.0.0.1:{port}/0")).await.err().unwrap();
    let message = error.to_string();
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
    assert!(!message.contains("hunter2"), "{message}");
}

async fn exercise_database(database: &Database) -> Result<()> {
    sqlx::query("CREATE TABLE runs (run_id TEXT PRIMARY KEY, status TEXT NOT NULL)").execute(database.pool()).await?;
    sqlx::query("INSERT INTO runs (run_id, status) VALUES ($1, $2)")
        .bind("run-1")
        .bind("running")
        .execute(database.pool())
        .await?;
    let status: String = sqlx::query_scalar("SELECT status FROM runs WHERE run_id = $1")
        .bind("run-1")
        .fetch_one(database.pool())
        .await?;
    assert_eq!(status, "running");
    assert_eq!(database.probe().check().await, Ok(()));
    Ok(())
}

#[tokio::test]
async fn sqlite_file_is_created_and_queried() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("runs.db");
    let database = Database::connect(&format!("sqlite://{}", path.display())).await?;
    exercise_database(&database).await?;
    assert!(path.exists());
    Ok(())
}

#[tokio::test]
async fn postgres_round_trip() -> Result<()> {
    let server = sleuth_testkit::postgres()?;
    let database = Database::connect(&sleuth_testkit::postgres_url(&server)).await?;
    exercise_database(&database).await
}

#[tokio::test]
async fn unknown_database_scheme_is_rejected_by_name() {
    let error = Database::connect("mysql://db/runs").await.err().unwrap().to_string();
    assert!(error.contains("database_url") && error.contains("mysql://db/runs"), "{error}");
}

async fn exercise_object_store(store: &ObjectStore) -> Result<()> {
    store.check().await?;
    store.put("index/bm25/meta.json", b"{\"docs\":3}".to_vec()).await?;
    store.put("index/vectors.bin", vec![7u8; 300_000]).await?;
    store.put("checkpoints/step-1/done", Vec::new()).await?;
    assert_eq!(store.get("index/bm25/meta.json").await?, b"{\"docs\":3}");
    assert_eq!(store.get("index/vectors.bin").await?.len(), 300_000);
    assert_eq!(store.list("index/").await?, ["index/bm25/meta.json", "index/vectors.bin"]);
    assert_eq!(store.list("").await?.len(), 3);
    // Downloads stream to a file, within the reader's limit or not at all.
    let scratch = tempfile::tempdir()?;
    let dest = scratch.path().join("vectors.bin");
    assert_eq!(store.download("index/vectors.bin", &dest, Some(300_000)).await?, 300_000);
    assert_eq!(std::fs::read(&dest)?, vec![7u8; 300_000]);
    let refused = store.download("index/vectors.bin", &scratch.path().join("big"), Some(299_999)).await.unwrap_err();
    assert!(matches!(refused, StoreError::TooLarge { limit: 299_999, .. }), "{refused}");
    assert!(refused.to_string().contains("larger than the 299999 bytes"), "{refused}");
    assert_eq!(std::fs::read_dir(scratch.path())?.count(), 1, "a refused download leaves no file");
    assert!(matches!(
        store.download("index/nothing", &scratch.path().join("n"), None).await,
        Err(StoreError::ObjectNotFound { .. })
    ));
    store.delete("index/vectors.bin").await?;
    store.delete("index/vectors.bin").await?;
    assert!(matches!(store.get("index/vectors.bin").await, Err(StoreError::ObjectNotFound { .. })));
    assert!(store.get("../outside").await.is_err());
    Ok(())
}

#[tokio::test]
async fn local_directory_object_store() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let store = ObjectStore::open(dir.path().join("store").to_str().unwrap(), &S3Args::default())?;
    exercise_object_store(&store).await
}

#[tokio::test]
async fn s3_object_store_against_real_server() -> Result<()> {
    let server = sleuth_testkit::s3()?;
    // SAFETY: nextest runs each test in its own process; nothing else reads the environment concurrently.
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", "sleuth-test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "sleuth-test-secret");
    }
    let args = S3Args { s3_endpoint: Some(sleuth_testkit::s3_endpoint(&server)), ..S3Args::default() };
    let store = ObjectStore::open("s3://sleuth-test/runs/r1", &args)?;
    assert!(store.check().await.is_err(), "bucket does not exist yet");
    if let ObjectStore::S3 { client, bucket, .. } = &store {
        client.create_bucket().bucket(bucket).send().await?;
    }
    exercise_object_store(&store).await?;
    // Keys live under the prefix in the bucket.
    let bucket_root = ObjectStore::open("s3://sleuth-test", &args)?;
    assert_eq!(bucket_root.list("runs/r1/index/").await?, ["runs/r1/index/bm25/meta.json"]);
    Ok(())
}

/// How EKS gives pods S3 access without keys (IRSA): a projected service
/// account token in a file and a role to assume with it. The default chain
/// trades the token for temporary credentials at STS (here moto's, which
/// accepts any token) and signs with those; with no token there are no
/// credentials and the request fails saying so.
#[tokio::test]
async fn s3_through_web_identity_credentials() -> Result<()> {
    let server = sleuth_testkit::s3()?;
    let endpoint = sleuth_testkit::s3_endpoint(&server);
    let dir = tempfile::tempdir()?;
    let token = dir.path().join("token");
    // SAFETY: nextest runs each test in its own process; nothing else reads the environment concurrently.
    unsafe {
        for static_key in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"] {
            std::env::remove_var(static_key);
        }
        std::env::set_var("AWS_CONFIG_FILE", dir.path().join("no-config"));
        std::env::set_var("AWS_SHARED_CREDENTIALS_FILE", dir.path().join("no-credentials"));
        std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
        std::env::set_var("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/sleuth-learner");
        std::env::set_var("AWS_WEB_IDENTITY_TOKEN_FILE", &token);
        std::env::set_var("AWS_ENDPOINT_URL_STS", &endpoint);
    }
    let args = S3Args { s3_endpoint: Some(endpoint), ..S3Args::default() };

    // No token yet: no provider in the chain has credentials.
    let store = ObjectStore::open("s3://identity/runs/r1", &args)?;
    let error = store.check().await.expect_err("S3 answered without credentials");
    let message = format!("{error:?}").to_lowercase();
    assert!(message.contains("credential"), "{message}");

    std::fs::write(&token, "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6c2xldXRoOmxlYXJuZXIifQ.c2ln")?;
    let store = ObjectStore::open("s3://identity/runs/r1", &args)?;
    if let ObjectStore::S3 { client, bucket, .. } = &store {
        client.create_bucket().bucket(bucket).send().await?;
    }
    exercise_object_store(&store).await
}

/// A lease has one holder: a second taker waits, told who holds it; a
/// holder whose lease expired is given it back when nobody took it since,
/// and fails to renew, naming the new holder, when someone did; a release
/// frees it at once.
#[tokio::test]
async fn a_lease_has_one_holder_at_a_time() -> Result<()> {
    use sleuth_store::lease::Lease;
    use std::time::Duration;
    let server = sleuth_testkit::redis()?;
    let redis = RedisStore::connect(&sleuth_testkit::redis_url(&server)).await?;
    let ttl = Duration::from_millis(600);
    let first = Lease::acquire(redis.clone(), "lease:test".into(), "first".into(), ttl, |_| {}).await?;
    first.renew().await?;
    // Expired while nobody else took it (Redis was unreachable, say): taken back.
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    first.renew().await?;

    // The second waits until the first's lease runs out, hearing who holds it.
    let mut heard = Vec::new();
    let second = Lease::acquire(redis.clone(), "lease:test".into(), "second".into(), ttl, |held| {
        heard.push(held.holder.clone());
    })
    .await?;
    assert!(!heard.is_empty() && heard.iter().all(|h| h == "first"), "{heard:?}");

    match first.renew().await {
        Err(StoreError::LeaseLost { now, .. }) => assert_eq!(now, "second"),
        other => panic!("the expired holder renewed: {other:?}"),
    }
    first.release().await?; // not its lease any more: a no-op
    second.renew().await?;

    // Released, it is free at once.
    second.release().await?;
    let started = std::time::Instant::now();
    let third = Lease::acquire(redis.clone(), "lease:test".into(), "third".into(), ttl, |_| {}).await?;
    assert!(started.elapsed() < ttl / 2, "a released lease is taken without waiting");
    third.renew().await?;
    Ok(())
}
