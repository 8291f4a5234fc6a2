//! The store clients over TLS, as managed Redis (`rediss://`) and PostgreSQL
//! (`sslmode=verify-full`) serve it: each server presents a certificate from
//! a throwaway authority, and a client trusts that authority and no other.

use anyhow::Result;
use sleuth_store::{Database, RedisStore};
use sleuth_testkit::tls::{TestCa, postgres_tls, redis_tls, redis_tls_url};

#[tokio::test]
async fn redis_over_tls_trusts_the_configured_authority_only() -> Result<()> {
    let ca = TestCa::new()?;
    let server = redis_tls(&ca)?;
    let url = redis_tls_url(&server);

    let store = RedisStore::open_trusting(&url, Some(&ca.ca_cert()))?;
    let mut connection = store.connection().await?;
    redis::cmd("XADD")
        .arg("trajectories")
        .arg("*")
        .arg("group")
        .arg("g-1")
        .query_async::<String>(&mut connection)
        .await?;
    let length: u64 = redis::cmd("XLEN").arg("trajectories").query_async(&mut connection).await?;
    assert_eq!(length, 1);

    // Another authority's certificate, or the system's roots (which do not
    // hold the test authority): the handshake fails, and the error names
    // the server and says why.
    let stranger = TestCa::new()?;
    for (store, trusting) in [
        (RedisStore::open_trusting(&url, Some(&stranger.ca_cert()))?, "another authority"),
        (RedisStore::open(&url)?, "the system's roots"),
    ] {
        let error = store.ping().await.expect_err("a server certificate from an untrusted authority was accepted");
        let message = format!("{error}: {:?}", std::error::Error::source(&error));
        assert!(message.contains(&url), "trusting {trusting}: {message}");
        assert!(message.to_lowercase().contains("certificate"), "trusting {trusting}: {message}");
    }
    Ok(())
}

#[test]
fn a_redis_ca_file_is_checked_before_anything_connects() {
    let error = RedisStore::open_trusting("redis://127.0.0.1:6379/0", Some("/etc/hostname".as_ref())).err().unwrap();
    assert!(error.to_string().contains("redis_ca_file") && error.to_string().contains("rediss://"), "{error}");
    let error = RedisStore::open_trusting("rediss://127.0.0.1:6379/0", Some("/no/such/ca.pem".as_ref())).err().unwrap();
    assert!(error.to_string().contains("redis_ca_file") && error.to_string().contains("/no/such/ca.pem"), "{error}");
}

#[tokio::test]
async fn postgres_verify_full_checks_the_server_certificate() -> Result<()> {
    let ca = TestCa::new()?;
    let server = postgres_tls(&ca)?;
    let base = sleuth_testkit::postgres_url(&server);

    let url = format!("{base}?sslmode=verify-full&sslrootcert={}", ca.ca_cert().display());
    let database = Database::connect(&url).await?;
    database.migrate().await?;
    let encrypted: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(database.pool())
        .await?;
    assert!(encrypted, "the session is not encrypted");

    let stranger = TestCa::new()?;
    let url = format!("{base}?sslmode=verify-full&sslrootcert={}", stranger.ca_cert().display());
    let error = Database::connect(&url).await.err().expect("a certificate from an untrusted authority was accepted");
    let message = format!("{error}: {:?}", std::error::Error::source(&error));
    assert!(message.to_lowercase().contains("certificate"), "{message}");
    Ok(())
}
