//! The dashboard behind the mesh's token. Programs send it as they do to
//! every service (`Authorization: Bearer <token>`); a browser signs in once
//! on `/login` and then carries a session cookie. The cookie holds an HMAC
//! of the token, not the token: it opens these read-only pages and nothing
//! else, and rotating the mesh token ends every session.

use axum::extract::{Form, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use hmac::{Hmac, Mac};
use sleuth_kit::BearerToken;

use super::html::{escape, page, percent_encode};

/// The session cookie's name.
pub const COOKIE: &str = "sleuth_dashboard";

/// Who may look: nobody needs to sign in on a mesh without a token.
#[derive(Clone)]
pub struct Gate {
    token: Option<BearerToken>,
}

impl Gate {
    pub fn new(token: Option<BearerToken>) -> Self {
        Self { token }
    }

    /// The session value a browser signed in with `token` carries.
    fn session(token: &BearerToken) -> String {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(token.secret()).expect("HMAC takes keys of any length");
        mac.update(b"sleuth dashboard session v1");
        mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `request` carries the mesh token or a session made from it.
    fn admits(&self, request: &Request) -> bool {
        let Some(token) = &self.token else { return true };
        let headers = request.headers();
        if headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).is_some_and(|h| token.matches_header(h)) {
            return true;
        }
        let expected = Self::session(token);
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))
            .any(|value| constant_time_eq(value.as_bytes(), expected.as_bytes()))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// Lets admitted requests through; sends a browser that is not signed in to
/// `/login` (back to where it was going afterwards), and answers other
/// requests 401.
pub async fn require(State(gate): State<Gate>, request: Request, next: Next) -> Response {
    if request.uri().path() == "/login" || gate.admits(&request) {
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
pub async fn login(State(gate): State<Gate>, Form(sign_in): Form<SignIn>) -> Response {
    let next = local(sign_in.next.as_deref()).to_owned();
    let Some(token) = &gate.token else { return Redirect::to(&next).into_response() };
    if !token.matches_header(&format!("Bearer {}", sign_in.token)) {
        let body = form(&next, "<p class=bad>That is not the mesh's token.</p>");
        return (StatusCode::UNAUTHORIZED, page("Sign in", &body)).into_response();
    }
    let cookie = format!("{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict", Gate::session(token));
    ([(header::SET_COOKIE, cookie)], Redirect::to(&next)).into_response()
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
    fn a_session_is_the_token_s_own_and_not_the_token() {
        let (a, b): (BearerToken, BearerToken) = ("secret-a".parse().unwrap(), "secret-b".parse().unwrap());
        let session = Gate::session(&a);
        assert_eq!(session.len(), 64);
        assert_ne!(session, Gate::session(&b));
        assert!(!session.contains("secret-a"));
        assert!(constant_time_eq(session.as_bytes(), Gate::session(&a).as_bytes()));
    }
}
