//! The dashboard's contract on a real database, through its router: the
//! mesh token guards every page (a browser signs in once and keeps a
//! session cookie; programs send the token), missing things are 404 pages
//! that name them, long lists are paged, and an episode whose group was
//! recorded before trajectories were kept says so instead of failing.

use std::time::Duration;

use anyhow::Result;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use rollout_orchestrator::dashboard::Dashboard;
use rollout_orchestrator::evaluate::Evaluator;
use rollout_orchestrator::runs::Runner;
use rollout_orchestrator::state::State;
use rollout_orchestrator::workers::Workers;
use sleuth_kit::BearerToken;
use sleuth_proto::rollout::v1::{EpisodeSummary, RunSpec};
use sleuth_store::{Database, RedisStore};
use tower::ServiceExt;

/// A dashboard over a fresh SQLite database under `dir` (no Redis or agent
/// worker is reached: the pages read the database only).
async fn dashboard(dir: &std::path::Path) -> Result<(Dashboard, State)> {
    let database = Database::open(&format!("sqlite://{}", dir.join("runs.db").display()))?;
    let state = State::open(database.clone()).await?;
    let workers = Workers::new(&[], None, Duration::from_secs(1), None)?;
    let report_dir = dir.join("evaluations");
    let evaluator = Evaluator {
        tools: None,
        workers: workers.clone(),
        report_dir: report_dir.clone(),
        jobs: rollout_orchestrator::jobs::Jobs::new(report_dir.clone()),
        task_roots: sleuth_store::LocalRoots { roots: Vec::new(), setting: "SLEUTH_TASK_ROOTS" },
        judge: None,
    };
    let runner = Runner::new(
        state.clone(),
        RedisStore::open("redis://127.0.0.1:9/0")?,
        workers,
        evaluator,
        Duration::from_secs(1),
    );
    Ok((Dashboard::new(runner, database, report_dir, None), state))
}

async fn get(
    router: &axum::Router,
    path: &str,
    headers: &[(header::HeaderName, &str)],
) -> Result<(StatusCode, axum::http::HeaderMap, String)> {
    let mut request = Request::get(path);
    for (name, value) in headers {
        request = request.header(name, *value);
    }
    let response = router.clone().oneshot(request.body(Body::empty())?).await?;
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await?;
    Ok((parts.status, parts.headers, String::from_utf8(body.to_vec())?))
}

#[tokio::test]
async fn the_mesh_token_guards_every_page_and_a_browser_signs_in_once() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (dashboard, _) = dashboard(dir.path()).await?;
    let token: BearerToken = "mesh-secret".parse()?;
    let router = dashboard.router(Some(token));

    // A browser that has not signed in is sent to /login, and back afterwards.
    let (status, headers, _) = get(&router, "/runs/r1?page=2", &[]).await?;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(headers[header::LOCATION], "/login?next=/runs/r1%3Fpage%3D2");
    let (status, _, form) = get(&router, "/login?next=/runs/r1%3Fpage%3D2", &[]).await?;
    assert_eq!(status, StatusCode::OK);
    assert!(form.contains("name=next value=\"/runs/r1?page=2\""), "{form}");

    // A program sends the token as every mesh client does.
    let (status, _, page) = get(&router, "/", &[(header::AUTHORIZATION, "Bearer mesh-secret")]).await?;
    assert_eq!(status, StatusCode::OK, "{page}");
    let (status, _, _) = get(&router, "/", &[(header::AUTHORIZATION, "Bearer wrong")]).await?;
    assert_eq!(status, StatusCode::SEE_OTHER);

    let sign_in = |token: &str| {
        Request::post("/login")
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(Body::from(format!("token={token}&next=%2Fruns%2Fr1")))
    };
    let refused = router.clone().oneshot(sign_in("wrong")?).await?;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert!(refused.headers().get(header::SET_COOKIE).is_none());
    let signed = router.clone().oneshot(sign_in("mesh-secret")?).await?;
    assert_eq!(signed.status(), StatusCode::SEE_OTHER);
    assert_eq!(signed.headers()[header::LOCATION], "/runs/r1");
    let cookie = signed.headers()[header::SET_COOKIE].to_str()?.to_owned();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"), "{cookie}");
    assert!(cookie.contains("Max-Age=43200") && !cookie.contains("Secure"), "a 12 h session over HTTP: {cookie}");
    assert!(!cookie.contains("mesh-secret"), "the cookie holds a session, not the token: {cookie}");
    let session = cookie.split(';').next().unwrap_or_default();
    let (status, _, _) = get(&router, "/", &[(header::COOKIE, &format!("theme=dark; {session}"))]).await?;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = get(&router, "/", &[(header::COOKIE, "sleuth_dashboard=forged")]).await?;
    assert_eq!(status, StatusCode::SEE_OTHER);

    // Every page refuses to be framed and runs no script.
    let (_, headers, _) = get(&router, "/", &[(header::COOKIE, session)]).await?;
    let policy = headers[header::CONTENT_SECURITY_POLICY].to_str()?;
    assert!(policy.contains("frame-ancestors 'none'") && policy.contains("default-src 'none'"), "{policy}");
    assert_eq!(headers[header::X_FRAME_OPTIONS], "DENY");

    // Behind a proxy that terminated TLS, the cookie is Secure.
    let over_https = Request::post("/login")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .header("x-forwarded-proto", "https")
        .body(Body::from("token=mesh-secret&next=%2F"))?;
    let cookie = router.clone().oneshot(over_https).await?.headers()[header::SET_COOKIE].to_str()?.to_owned();
    assert!(cookie.contains("; Secure"), "{cookie}");

    // Signing out drops the cookie from the browser.
    let signed_out = router.clone().oneshot(Request::post("/logout").body(Body::empty())?).await?;
    assert_eq!(signed_out.headers()[header::LOCATION], "/login");
    let dropped = signed_out.headers()[header::SET_COOKIE].to_str()?;
    assert!(dropped.starts_with("sleuth_dashboard=;") && dropped.contains("Max-Age=0"), "{dropped}");

    // Never sent to another site after signing in.
    let elsewhere = Request::post("/login")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from("token=mesh-secret&next=%2F%2Fevil.example%2F"))?;
    assert_eq!(router.clone().oneshot(elsewhere).await?.headers()[header::LOCATION], "/");
    Ok(())
}

#[tokio::test]
async fn missing_things_are_named_and_long_lists_are_paged() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (dashboard, state) = dashboard(dir.path()).await?;
    let router = dashboard.router(None);

    let (status, _, page) = get(&router, "/runs/nope", &[]).await?;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(page.contains("no run &quot;nope&quot;"), "{page}");

    state.create("r1", &RunSpec { name: "paged".into(), group_size: 4, ..Default::default() }).await?;
    for i in 0..120 {
        let summary = EpisodeSummary {
            episode_id: format!("r1-e0-q{:03}-{}", i / 4, i % 4),
            task_id: format!("q{}", i / 4),
            reward: f64::from(i % 4) / 4.0,
            ..Default::default()
        };
        state.record_episode("r1", &format!("e0-q{:03}", i / 4), &summary).await?;
    }
    let (status, _, first) = get(&router, "/runs/r1", &[]).await?;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first.matches("href=\"/runs/r1/episodes/").count(), 50, "a page holds 50 episodes");
    assert!(first.contains("Episodes (120)") && first.contains("href=\"/runs/r1?page=1#episodes\""));
    assert!(first.contains("data-metric=\"reward\" data-points=\"1\""), "the training reward of version 0");
    let (_, _, last) = get(&router, "/runs/r1?page=2", &[]).await?;
    assert_eq!(last.matches("href=\"/runs/r1/episodes/").count(), 20);
    assert!(!last.contains("?page=3") && last.contains("?page=1"), "no next page after the last");

    // The episode exists, its group was never recorded with trajectories.
    let (status, _, episode) = get(&router, "/runs/r1/episodes/r1-e0-q000-1", &[]).await?;
    assert_eq!(status, StatusCode::OK, "{episode}");
    assert!(episode.contains("its turns cannot be shown"), "{episode}");
    let (status, _, page) = get(&router, "/runs/r1/episodes/r1-e9-q9-0", &[]).await?;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(page.contains("has no episode"), "{page}");

    // A report that is not one is named, not skipped silently.
    std::fs::create_dir_all(dir.path().join("evaluations"))?;
    std::fs::write(dir.path().join("evaluations").join("broken.json"), b"{not json")?;
    let (status, _, evaluations) = get(&router, "/evaluations", &[]).await?;
    assert_eq!(status, StatusCode::OK);
    assert!(evaluations.contains("not a report") && evaluations.contains("broken.json"), "{evaluations}");
    let (status, _, page) = get(&router, "/evaluations?against=eval-missing", &[]).await?;
    assert_eq!(status, StatusCode::NOT_FOUND, "{page}");
    Ok(())
}
