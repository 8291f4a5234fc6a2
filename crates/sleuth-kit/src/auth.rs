//! Bearer-token authentication between the services of a mesh.
//!
//! One shared token (a Kubernetes secret) guards every RPC except gRPC health,
//! which Kubernetes probes and load balancers must reach unauthenticated.
//! The calls that change what the mesh serves can have tokens of their own
//! (scopes): publishing weights (`SLEUTH_PUBLISH_TOKEN`, held by the learner
//! only) and administration (`SLEUTH_ADMIN_TOKEN`: collections, creating and
//! cancelling runs). A scoped call then opens only with its scope's token, so
//! a holder of the mesh token (any agent pod) can no longer make a policy
//! server load weights or a tool gateway read or write collections.

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

    /// The secret itself, as key material (the dashboard's session MAC is
    /// keyed by it); never log it.
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

/// Which token opens which call: the mesh token opens every call except
/// those with a scope token of their own, which only that token opens.
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// The mesh's token; None: calls outside a scope need no token.
    mesh: Option<BearerToken>,
    /// gRPC paths (`/package.Service/Method`), the token each needs and the
    /// setting that names it (for the error a wrong token gets).
    scoped: Vec<(String, BearerToken, &'static str)>,
}

impl Access {
    /// Every call opened by `mesh` (or by anyone, when None).
    pub fn mesh(mesh: Option<BearerToken>) -> Self {
        Self { mesh, scoped: Vec::new() }
    }

    /// `path` opens only with `token`, the value of `setting`.
    pub fn scope(mut self, path: String, token: BearerToken, setting: &'static str) -> Self {
        self.scoped.push((path, token, setting));
        self
    }

    /// Whether any call needs a token.
    pub fn is_guarded(&self) -> bool {
        self.mesh.is_some() || !self.scoped.is_empty()
    }

    /// Whether a call to `path` with the `authorization` header `presented`
    /// may proceed: `PermissionDenied` for the mesh token on a scoped call.
    pub fn check(&self, path: &str, presented: Option<&str>) -> Result<(), KitError> {
        let presented = presented.unwrap_or_default();
        let mesh_matches = self.mesh.as_ref().is_some_and(|token| token.matches_header(presented));
        match self.scoped.iter().find(|(scoped, _, _)| scoped == path) {
            Some((_, token, _)) if token.matches_header(presented) => Ok(()),
            Some((path, _, setting)) if mesh_matches => Err(KitError::PermissionDenied { path: path.clone(), setting }),
            Some(_) => Err(KitError::Unauthenticated),
            None if self.mesh.is_none() || mesh_matches => Ok(()),
            None => Err(KitError::Unauthenticated),
        }
    }
}

/// Rejects requests whose bearer token does not open their call (see
/// [`Access`]) with `Unauthenticated` or `PermissionDenied`, before they
/// reach any handler or take any capacity.
#[derive(Clone, Debug)]
pub struct RequireBearerLayer {
    access: Arc<Access>,
}

impl RequireBearerLayer {
    pub fn new(access: Access) -> Self {
        Self { access: Arc::new(access) }
    }
}

impl<S> Layer<S> for RequireBearerLayer {
    type Service = RequireBearer<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequireBearer { inner, access: self.access.clone() }
    }
}

/// The service produced by [`RequireBearerLayer`].
#[derive(Clone, Debug)]
pub struct RequireBearer<S> {
    inner: S,
    access: Arc<Access>,
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
        let presented =
            request.headers().get(http::header::AUTHORIZATION).and_then(|value: &HeaderValue| value.to_str().ok());
        match self.access.check(request.uri().path(), presented) {
            Ok(()) => Either::Right(self.inner.call(request)),
            Err(error) => Either::Left(ready(Ok(into_status(&error).into_http()))),
        }
    }
}

/// Client-side interceptor on every mesh channel: adds the bearer token (when
/// there is one) and the current trace context to every outgoing call.
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
        crate::trace_context::inject(request.metadata_mut());
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

    #[test]
    fn a_scoped_call_opens_only_with_its_own_token() {
        let publish: BearerToken = "publish-secret".parse().unwrap();
        let path = "/sleuth.policy.v1.PolicyServer/UpdateWeights";
        let access = Access::mesh(Some(token())).scope(path.to_owned(), publish, "SLEUTH_PUBLISH_TOKEN");
        assert!(access.check(path, Some("Bearer publish-secret")).is_ok());
        let denied = access.check(path, Some("Bearer mesh-secret")).unwrap_err();
        assert!(
            matches!(denied, KitError::PermissionDenied { .. }) && denied.to_string().contains("SLEUTH_PUBLISH_TOKEN")
        );
        assert!(matches!(access.check(path, None), Err(KitError::Unauthenticated)));
        // Other calls: the mesh token, not the scope's.
        assert!(access.check("/sleuth.policy.v1.PolicyServer/Generate", Some("Bearer mesh-secret")).is_ok());
        assert!(access.check("/sleuth.policy.v1.PolicyServer/Generate", Some("Bearer publish-secret")).is_err());
        // Without a mesh token only the scoped call is guarded.
        let open = Access::mesh(None).scope(path.to_owned(), "p".parse().unwrap(), "SLEUTH_PUBLISH_TOKEN");
        assert!(open.check("/sleuth.policy.v1.PolicyServer/Generate", None).is_ok());
        assert!(open.check(path, None).is_err());
    }

    #[tokio::test]
    async fn unauthenticated_requests_get_unauthenticated_status() {
        use tower::ServiceExt;
        let inner = tower::service_fn(|_: Request<()>| async {
            Ok::<_, std::convert::Infallible>(Response::new(String::from("handled")))
        });
        let service = RequireBearerLayer::new(Access::mesh(Some(token()))).layer(inner);

        let anonymous = service.clone().oneshot(Request::new(())).await.unwrap();
        assert_eq!(anonymous.headers()["grpc-status"], "16");
        assert!(anonymous.body().is_empty());

        let request = Request::builder().header("authorization", "Bearer mesh-secret").body(()).unwrap();
        let authorized = service.oneshot(request).await.unwrap();
        assert_eq!(authorized.body(), "handled");
    }
}
