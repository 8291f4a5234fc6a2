//! The dashboard behind the mesh's token. Programs send it as they do to
//! every service (`Authorization: Bearer <token>`); a browser signs in once
//! on `/login` and then carries a session cookie for [`SESSION_TTL`]. The
//! cookie holds when it was issued and an HMAC of that keyed by the token,
//! not the token: it opens these read-only pages and nothing else, expires
//! by itself, and rotating the mesh token ends every session. `/logout`
//! drops it from the browser. Over HTTPS (the dashboard's own TLS, or a
//! TLS-terminating proxy that says `X-Forwarded-Proto: https`) the cookie is `Secure`.

use axum::extract::{Form, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use hmac::{Hmac, Mac};
use sleuth_kit::BearerToken;

use super::html::{escape, page, percent_encode};

/// The session cookie's name.
pub const COOKIE: &str = "sleuth_dashboard";

/// How long a session lasts after signing in.
pub const SESSION_TTL: std::time::Duration = std::time::Duration::from_secs(12 * 3600);

/// Who may look: nobody needs to sign in on a mesh without a token.
#[derive(Clone)]
pub struct Gate {
    token: Option<BearerToken>,
}

impl Gate {
    pub fn new(token: Option<BearerToken>) -> Self {
        Self { token }
    }

    /// The session value a browser signed in with `token` at `issued`
    /// (seconds since the epoch) carries: `<issued>.<hmac>`.
    fn session(token: &BearerToken, issued: u64) -> String {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(token.secret()).expect("HMAC takes keys of any length");
        mac.update(format!("sleuth dashboard session v2 {issued}").as_bytes());
        let tag: String = mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
        format!("{issued}.{tag}")
    }

    /// Whether `value` is a session made from `token` that has not expired at `now`.
    fn valid_session(token: &BearerToken, value: &str, now: u64) -> bool {
        let Some(issued) = value.split_once('.').and_then(|(issued, _)| issued.parse::<u64>().ok()) else {
            return false;
        };
        // A minute of clock skew between replicas; never a session from the future.
        let fresh = issued <= now + 60 && now.saturating_sub(issued) < SESSION_TTL.as_secs();
        fresh && constant_time_eq(value.as_bytes(), Self::session(token, issued).as_bytes())
    }

    /// Whether `request` carries the mesh token or a session made from it.
    fn admits(&self, request: &Request) -> bool {
        let Some(token) = &self.token else { return true };
        let headers = request.headers();
        if headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).is_some_and(|h| token.matches_header(h)) {
            return true;
        }
        let now = now();
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))
            .any(|value| Self::valid_session(token, value, now))
    }
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The cookie's attributes: `Secure` when the browser reached the dashboard
/// over HTTPS: the dashboard's own TLS, or a proxy that terminated TLS and said so.
fn attributes(headers: &axum::http::HeaderMap, max_age: u64) -> String {
    let https = sleuth_kit::tls::installed().is_some()
        || headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok()).is_some_and(|p| p == "https");
    format!("Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{}", if https { "; Secure" } else { "" })
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// Lets admitted requests through; sends a browser that is not signed in to
/// `/login` (back to where it was going afterwards), and answers other
/// requests 401.
pub async fn require(State(gate): State<Gate>, request: Request, next: Next) -> Response {
    if matches!(request.uri().path(), "/login" | "/logout") || gate.admits(&request) {
        return next.run(request).await;
    }
    if request.method() == axum::http::Method::GET {
        let back = request.uri().path_and_query().map_or("/", |p| p.as_str());
        let target = percent_encode(back, b"/");
        return Redirect::to(&format!("/login?next={target}")).into_response();
    }
    (StatusCode::UNAUTHORIZED, "sign in on /login or send the mesh token as a bearer token").into_response()
}

/// Where to go after signing in: only a path of this site, never another origin.
fn local(next: Option<&str>) -> &str {
    match next {
        Some(path) if path.starts_with('/') && !path.starts_with("//") && !path.contains('\\') => path,
        _ => "/",
    }
}

#[derive(serde::Deserialize)]
pub struct LoginQuery {
    next: Option<String>,
}

#[derive(serde::Deserialize)]
pub struct SignIn {
    token: String,
    next: Option<String>,
}

fn form(next: &str, problem: &str) -> String {
    format!(
        "<h1>Sign in</h1><p>The dashboard opens with the mesh's token (SLEUTH_AUTH_TOKEN).</p>{problem}\
         <form method=post action=\"/login\"><input type=hidden name=next value=\"{}\">\
         <input type=password name=token autofocus size=40> <button>Sign in</button></form>",
        escape(next)
    )
}

/// `GET /login`.
pub async fn login_form(Query(query): Query<LoginQuery>) -> Response {
    page("Sign in", &form(local(query.next.as_deref()), "")).into_response()
}

/// `POST /login`: the token checked, the session cookie set.
pub async fn login(State(gate): State<Gate>, headers: axum::http::HeaderMap, Form(sign_in): Form<SignIn>) -> Response {
    let next = local(sign_in.next.as_deref()).to_owned();
    let Some(token) = &gate.token else { return Redirect::to(&next).into_response() };
    if !token.matches_header(&format!("Bearer {}", sign_in.token)) {
        let body = form(&next, "<p class=bad>That is not the mesh's token.</p>");
        return (StatusCode::UNAUTHORIZED, page("Sign in", &body)).into_response();
    }
    let cookie = format!("{COOKIE}={}; {}", Gate::session(token, now()), attributes(&headers, SESSION_TTL.as_secs()));
    ([(header::SET_COOKIE, cookie)], Redirect::to(&next)).into_response()
}

/// `POST /logout`: the browser drops its session cookie.
pub async fn logout(headers: axum::http::HeaderMap) -> Response {
    let cookie = format!("{COOKIE}=; {}", attributes(&headers, 0));
    ([(header::SET_COOKIE, cookie)], Redirect::to("/login")).into_response()
}

/// Headers on every page: no framing by another site (clickjacking), no
/// scripts at all, nothing loaded from elsewhere, forms posted here only.
pub async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        axum::http::HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(header::X_FRAME_OPTIONS, axum::http::HeaderValue::from_static("DENY"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, axum::http::HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, axum::http::HeaderValue::from_static("no-referrer"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_local_paths_are_followed_after_signing_in() {
        assert_eq!(local(Some("/runs/a?page=2")), "/runs/a?page=2");
        for elsewhere in ["//evil.example/", "https://evil.example/", "/\\evil", ""] {
            assert_eq!(local(Some(elsewhere)), "/", "{elsewhere}");
        }
        assert_eq!(local(None), "/");
    }

    #[test]
    fn a_session_is_the_token_s_own_and_not_the_token_and_it_expires() {
        let (a, b): (BearerToken, BearerToken) = ("secret-a".parse().unwrap(), "secret-b".parse().unwrap());
        let issued = 1_800_000_000;
        let session = Gate::session(&a, issued);
        assert_ne!(session, Gate::session(&b, issued));
        assert!(!session.contains("secret-a"));
        assert!(Gate::valid_session(&a, &session, issued + 10));
        assert!(!Gate::valid_session(&b, &session, issued + 10), "another token's session");
        let ttl = SESSION_TTL.as_secs();
        assert!(!Gate::valid_session(&a, &session, issued + ttl), "an expired session");
        assert!(!Gate::valid_session(&a, &session, issued - 3600), "a session from the future");
        // Moving the issue time forward breaks the HMAC.
        let forged = session.replacen(&issued.to_string(), &(issued + ttl).to_string(), 1);
        assert!(!Gate::valid_session(&a, &forged, issued + ttl + 10));
    }
}
