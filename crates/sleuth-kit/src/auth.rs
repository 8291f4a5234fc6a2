//! Bearer-token authentication between the services of a mesh.
//!
//! One shared token (a Kubernetes secret) guards every RPC except gRPC health,
//! which Kubernetes probes and load balancers must reach unauthenticated.
//! Weight updates above all must never be callable by strangers.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{Either, Ready, ready};
use http::{HeaderValue, Request, Response};
use tonic::metadata::MetadataValue;
use tower::{Layer, Service};

use crate::error::{KitError, into_status};

/// A shared secret. Its `Debug` output never shows the value, so it cannot
/// leak through logged configuration.
#[derive(Clone, PartialEq, Eq)]
pub struct BearerToken(Arc<str>);

impl BearerToken {
    /// True when an `authorization` header value carries exactly this token.
    /// The comparison takes the same time wherever the first difference is,
    /// so the token cannot be guessed byte by byte from response times.
    pub fn matches_header(&self, header: &str) -> bool {
        let Some(presented) = header.strip_prefix("Bearer ") else {
            return false;
        };
        let (a, b) = (presented.as_bytes(), self.0.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
    }

    /// The secret itself, as key material (the learner ranks' handshake MACs
    /// are keyed by it); never log it.
    pub fn secret(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// The `authorization` metadata value clients send.
    pub fn header_value(&self) -> MetadataValue<tonic::metadata::Ascii> {
        format!("Bearer {}", self.0).parse().expect("token was validated as visible ASCII")
    }
}

impl FromStr for BearerToken {
    type Err = KitError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let invalid = |message: &str| KitError::Config { field: "auth_token", message: message.to_owned() };
        if value.is_empty() {
            return Err(invalid("is empty"));
        }
        if !value.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid("must be visible ASCII without spaces"));
        }
        Ok(Self(value.into()))
    }
}

impl fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BearerToken(<redacted>)")
    }
}

/// Rejects requests that do not carry the mesh's bearer token with
/// `Unauthenticated`, before they reach any handler or take any capacity.
#[derive(Clone, Debug)]
pub struct RequireBearerLayer {
    token: BearerToken,
}

impl RequireBearerLayer {
    pub fn new(token: BearerToken) -> Self {
        Self { token }
    }
}

impl<S> Layer<S> for RequireBearerLayer {
    type Service = RequireBearer<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequireBearer { inner, token: self.token.clone() }
    }
}

/// The service produced by [`RequireBearerLayer`].
#[derive(Clone, Debug)]
pub struct RequireBearer<S> {
    inner: S,
    token: BearerToken,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RequireBearer<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Default,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<Ready<Result<Self::Response, Self::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let authorized = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|value: &HeaderValue| value.to_str().ok())
            .is_some_and(|value| self.token.matches_header(value));
        if authorized {
            Either::Right(self.inner.call(request))
        } else {
            let status = into_status(&KitError::Unauthenticated);
            Either::Left(ready(Ok(status.into_http())))
        }
    }
}

/// Client-side interceptor adding the bearer token to every outgoing call.
/// Without a token it passes requests through unchanged.
#[derive(Clone, Debug, Default)]
pub struct BearerInterceptor {
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl BearerInterceptor {
    pub fn new(token: Option<&BearerToken>) -> Self {
        Self { header: token.map(BearerToken::header_value) }
    }
}

impl tonic::service::Interceptor for BearerInterceptor {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(header) = &self.header {
            request.metadata_mut().insert("authorization", header.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> BearerToken {
        "mesh-secret".parse().unwrap()
    }

    #[test]
    fn accepts_only_the_exact_token() {
        assert!(token().matches_header("Bearer mesh-secret"));
        assert!(!token().matches_header("Bearer mesh-secreT"));
        assert!(!token().matches_header("Bearer mesh-secret2"));
        assert!(!token().matches_header("mesh-secret"));
        assert!(!token().matches_header("Basic mesh-secret"));
    }

    #[test]
    fn debug_never_shows_the_secret() {
        assert!(!format!("{:?}", token()).contains("mesh-secret"));
    }

    #[test]
    fn rejects_tokens_that_cannot_be_sent_as_headers() {
        assert!("".parse::<BearerToken>().is_err());
        assert!("two words".parse::<BearerToken>().is_err());
        assert!("line\nbreak".parse::<BearerToken>().is_err());
    }

    #[tokio::test]
    async fn unauthenticated_requests_get_unauthenticated_status() {
        use tower::ServiceExt;
        let inner = tower::service_fn(|_: Request<()>| async {
            Ok::<_, std::convert::Infallible>(Response::new(String::from("handled")))
        });
        let service = RequireBearerLayer::new(token()).layer(inner);

        let anonymous = service.clone().oneshot(Request::new(())).await.unwrap();
        assert_eq!(anonymous.headers()["grpc-status"], "16");
        assert!(anonymous.body().is_empty());

        let request = Request::builder().header("authorization", "Bearer mesh-secret").body(()).unwrap();
        let authorized = service.oneshot(request).await.unwrap();
        assert_eq!(authorized.body(), "handled");
    }
}
