//! A client of an OpenAI-compatible chat endpoint (`POST
//! <url>/v1/chat/completions`): an inference gateway's HTTP door in front of
//! a policy-server pool, or any hosted endpoint by URL and token. The
//! orchestrator's LLM judge and the agent's model teacher ask models outside
//! the policy through it.
//!
//! One call is one request; callers that ride out a restarting endpoint
//! make their calls through [`attempts`].

use std::time::Duration;

use serde_json::Value;

use crate::BearerToken;

/// Header naming the episode a call belongs to. A Sleuth gateway records
/// each episode's turns as one trace; other endpoints ignore it.
pub const EPISODE_HEADER: &str = "x-sleuth-episode-id";

/// A configured endpoint.
#[derive(Clone)]
pub struct ChatEndpoint {
    http: reqwest::Client,
    url: String,
    token: Option<BearerToken>,
    model: String,
}

impl ChatEndpoint {
    /// The endpoint at base URL `url` (requests go to
    /// `<url>/v1/chat/completions`), sending `token` as a bearer token when
    /// given and `model` as each request's `model`; each call ends after
    /// `timeout`. An error names the setting as `field`.
    pub fn new(
        field: &str,
        url: &str,
        token: Option<BearerToken>,
        model: &str,
        timeout: Duration,
    ) -> Result<Self, String> {
        let base = url.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(format!("{field} {url:?} must start with http:// or https://"));
        }
        // reqwest is built without a crypto provider of its own: it uses the
        // process's, aws-lc-rs as everywhere in the workspace (another
        // caller may have installed it first).
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| format!("{field} {url:?}: cannot make an HTTP client: {e}"))?;
        Ok(Self { http, url: format!("{base}/v1/chat/completions"), token, model: model.to_owned() })
    }

    /// The same endpoint asked for `model` (one endpoint may serve several).
    pub fn for_model(&self, model: &str) -> Self {
        Self { model: model.to_owned(), ..self.clone() }
    }

    /// Where requests go (`<url>/v1/chat/completions`), for errors and logs.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// One call with `body` (its `messages`, `tools` and sampling; the
    /// endpoint's `model` is added) for `episode`: the reply's
    /// `choices[0].message`, or why there is none.
    pub async fn complete(&self, episode: &str, mut body: Value) -> Result<Value, String> {
        body["model"] = Value::String(self.model.clone());
        let mut request = self.http.post(&self.url).header(EPISODE_HEADER, episode).json(&body);
        if let Some(token) = &self.token {
            request = request.bearer_auth(String::from_utf8_lossy(token.secret()));
        }
        let response = request.send().await.map_err(|e| format!("calling {}: {e}", self.url))?;
        let status = response.status();
        let mut reply: Value =
            response.json().await.map_err(|e| format!("the reply of {} ({status}) is not JSON: {e}", self.url))?;
        if !status.is_success() {
            let message = reply["error"]["message"].as_str().unwrap_or("");
            return Err(format!("{} answered {status}: {message}", self.url));
        }
        match reply["choices"][0]["message"].take() {
            Value::Object(message) => Ok(Value::Object(message)),
            _ => Err(format!("the reply of {} has no choices[0].message", self.url)),
        }
    }
}

/// The wait before retry `attempt` (1, 2, ...): 1 s, 2 s, 4 s, ... up to
/// 32 s, long enough for an endpoint's pod to come back.
pub fn backoff(attempt: u32) -> Duration {
    Duration::from_secs(1 << attempt.saturating_sub(1).min(5))
}

/// `call(attempt)` for attempts 0, 1, ... up to `attempts`, [`backoff`]
/// apart, until one succeeds; each failure is logged as `what` failed. The
/// error is the last attempt's.
pub async fn attempts<T, F, Call>(attempts: u32, what: &str, mut call: Call) -> Result<T, String>
where
    // A plain closure returning a future, not `AsyncFnMut`: a service's
    // handler future must be `Send`, which `AsyncFnMut` cannot yet promise.
    Call: FnMut(u32) -> F,
    F: std::future::Future<Output = Result<T, String>>,
{
    let mut last = String::new();
    for attempt in 0..attempts {
        if attempt > 0 {
            tokio::time::sleep(backoff(attempt)).await;
        }
        match call(attempt).await {
            Ok(value) => return Ok(value),
            Err(error) => last = error,
        }
        tracing::warn!(attempt, error = %last, "{what} failed; asking again");
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_without_a_scheme_is_named() {
        let error =
            ChatEndpoint::new("teacher_url", "gateway:8080", None, "m", Duration::from_secs(1)).err().expect("refused");
        assert_eq!(error, "teacher_url \"gateway:8080\" must start with http:// or https://");
        let endpoint = ChatEndpoint::new("teacher_url", "http://gateway:8080/", None, "m", Duration::from_secs(1));
        assert_eq!(endpoint.map(|e| e.url().to_owned()), Ok("http://gateway:8080/v1/chat/completions".into()));
    }

    #[test]
    fn backoff_doubles_to_half_a_minute() {
        let waits: Vec<u64> = (1..=8).map(|attempt| backoff(attempt).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 32, 32]);
    }
}
