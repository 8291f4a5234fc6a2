//! The OpenAI-compatible front door: `POST /v1/chat/completions` (episode in
//! the `x-sleuth-episode-id` header) and `POST /episodes/{id}/v1/chat/completions`,
//! so an agent written for the OpenAI API, in any language, can be the
//! rollout environment unchanged. Same behaviour as gRPC `Chat`.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::Deserialize;
use serde_json::{Value, json};
use sleuth_kit::trace_context::route_span;
use sleuth_kit::{BearerToken, ErrorKind, ServiceError};
use sleuth_proto::common::v1::{ChatMessage, SamplingParams, ToolCall, ToolSpec};
use sleuth_proto::inference::v1::ChatRequest;

use crate::error::Error;
use crate::handlers::Handlers;

/// Header naming the episode on `/v1/chat/completions` (the one Sleuth's
/// own clients of a chat endpoint send).
pub use sleuth_kit::chat_endpoint::EPISODE_HEADER;
/// Header carrying the episode's ticket (`ChatRequest.ticket`), on either route.
pub const TICKET_HEADER: &str = "x-sleuth-episode-ticket";

#[derive(Clone)]
struct AppState {
    handlers: Arc<Handlers>,
}

const CHAT: &str = "/v1/chat/completions";
/// Episode ids in paths; spans are named after the route.
const EPISODE_CHAT: &str = "/episodes/{episode}/v1/chat/completions";

/// The endpoint behind the same guards as the gRPC services, from the outside
/// in: the bearer token, checked before the body is read; load shedding and a
/// concurrency limit (`SLEUTH_MAX_CONCURRENT_REQUESTS`, counted apart from
/// gRPC's), so a flood gets 429 with retry advice instead of queueing
/// unbounded; and the request timeout (`SLEUTH_REQUEST_TIMEOUT`).
pub fn router(handlers: Arc<Handlers>, token: Option<BearerToken>, serve: &sleuth_kit::ServeArgs) -> axum::Router {
    let limits = tower::ServiceBuilder::new()
        .layer(axum::error_handling::HandleErrorLayer::new(overloaded))
        .layer(tower::load_shed::LoadShedLayer::new())
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(serve.max_concurrent_requests as usize));
    axum::Router::new()
        .route(CHAT, post(from_header).layer(from_fn_with_state(CHAT, route_span)))
        .route(EPISODE_CHAT, post(from_path).layer(from_fn_with_state(EPISODE_CHAT, route_span)))
        .with_state(AppState { handlers })
        .layer(from_fn_with_state(serve.request_timeout, within))
        .layer(limits)
        .layer(from_fn_with_state(token, authenticate))
}

/// Turns away a request without the mesh's token before anything reads its body.
async fn authenticate(
    State(token): State<Option<BearerToken>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let presented = request.headers().get("authorization").and_then(|v| v.to_str().ok()).unwrap_or_default();
    match &token {
        Some(token) if !token.matches_header(presented) => {
            ApiError(Error::Kit(sleuth_kit::KitError::Unauthenticated)).into_response()
        }
        _ => next.run(request).await,
    }
}

/// Ends a request that runs past `timeout` with 504.
async fn within(
    State(timeout): State<std::time::Duration>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match tokio::time::timeout(timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            let message = format!("no answer within the request timeout {timeout:?} (SLEUTH_REQUEST_TIMEOUT)");
            let body = json!({"error": {"message": message, "type": "server_error", "code": null}});
            (StatusCode::GATEWAY_TIMEOUT, Json(body)).into_response()
        }
    }
}

/// The limit layers' only error is tower's `Overloaded`: 429 with retry advice.
async fn overloaded(error: tower::BoxError) -> Response {
    let error = if error.is::<tower::load_shed::error::Overloaded>() {
        Error::Kit(sleuth_kit::KitError::Overloaded)
    } else {
        Error::Internal(format!("request stack: {error}"))
    };
    ApiError(error).into_response()
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    messages: Vec<MessageIn>,
    #[serde(default)]
    tools: Vec<ToolIn>,
    #[serde(default)]
    tool_choice: Option<Value>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    logprobs: bool,
}

#[derive(Debug, Deserialize)]
struct MessageIn {
    role: String,
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    tool_calls: Vec<ToolCallIn>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ToolCallIn {
    #[serde(default)]
    id: String,
    function: FunctionCallIn,
}

#[derive(Debug, Deserialize)]
struct FunctionCallIn {
    name: String,
    #[serde(default)]
    arguments: String,
}

#[derive(Debug, Deserialize)]
struct ToolIn {
    function: FunctionIn,
}

#[derive(Debug, Deserialize)]
struct FunctionIn {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    parameters: Option<Value>,
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "code"}}`.
struct ApiError(Error);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind) = match self.0.kind() {
            ErrorKind::InvalidArgument => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found_error"),
            ErrorKind::Unauthenticated => (StatusCode::UNAUTHORIZED, "authentication_error"),
            ErrorKind::PermissionDenied => (StatusCode::FORBIDDEN, "permission_error"),
            ErrorKind::ResourceExhausted { .. } => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            ErrorKind::FailedPrecondition | ErrorKind::AlreadyExists | ErrorKind::Aborted => {
                (StatusCode::CONFLICT, "invalid_request_error")
            }
            ErrorKind::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
            ErrorKind::Unimplemented | ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
        };
        let body = json!({"error": {"message": sleuth_kit::error::into_status(&self.0).message(), "type": kind, "code": null}});
        let mut response = (status, Json(body)).into_response();
        if let ErrorKind::ResourceExhausted { retry_after } = self.0.kind() {
            let seconds = retry_after.as_secs().max(1).to_string();
            response.headers_mut().insert("retry-after", seconds.parse().expect("digits are a header value"));
        }
        response
    }
}

async fn from_header(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Json<Value>,
) -> Result<Json<Value>, ApiError> {
    let episode = headers.get(EPISODE_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    if episode.is_empty() {
        return Err(ApiError(Error::InvalidArgument(format!(
            "name the episode with the {EPISODE_HEADER} header or POST to /episodes/{{id}}/v1/chat/completions"
        ))));
    }
    complete(&state, &headers, episode, body.0).await
}

async fn from_path(
    State(state): State<AppState>,
    Path(episode): Path<String>,
    headers: HeaderMap,
    body: Json<Value>,
) -> Result<Json<Value>, ApiError> {
    complete(&state, &headers, episode, body.0).await
}

/// The turn a request body asks for, or what is wrong with it (naming the field).
pub fn chat_request(episode: &str, body: Value) -> Result<ChatRequest, Error> {
    let request: CompletionRequest =
        serde_json::from_value(body).map_err(|e| Error::InvalidArgument(format!("request body: {e}")))?;
    if request.tool_choice.as_ref().is_some_and(|c| c != "auto" && c != "none") {
        return Err(Error::InvalidArgument(format!(
            "tool_choice {} is not supported (auto or none)",
            request.tool_choice.unwrap_or_default()
        )));
    }
    let stop = match request.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(stop)) => vec![stop],
        Some(Value::Array(items)) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(stop) => Ok(stop),
                other => Err(Error::InvalidArgument(format!("stop[{i}] must be a string, got {other}"))),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(Error::InvalidArgument(format!("stop must be a string or an array of strings, got {other}")));
        }
    };
    let tools = if request.tool_choice.as_ref().is_some_and(|c| c == "none") { Vec::new() } else { request.tools };
    let messages = request
        .messages
        .into_iter()
        .enumerate()
        .map(|(index, message)| {
            let content = match message.content {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(text)) => text,
                Some(other) => {
                    return Err(Error::InvalidArgument(format!(
                        "messages[{index}].content must be a string, got {}",
                        sleuth_chat_shorten(&other.to_string())
                    )));
                }
            };
            Ok(ChatMessage {
                role: message.role,
                content,
                tool_calls: message
                    .tool_calls
                    .into_iter()
                    .map(|call| ToolCall {
                        id: call.id,
                        name: call.function.name,
                        arguments_json: call.function.arguments,
                    })
                    .collect(),
                tool_call_id: message.tool_call_id.unwrap_or_default(),
                name: message.name.unwrap_or_default(),
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(ChatRequest {
        episode_id: episode.to_owned(),
        messages,
        tools: tools
            .into_iter()
            .map(|tool| ToolSpec {
                name: tool.function.name,
                description: tool.function.description,
                parameters_json: tool.function.parameters.unwrap_or_else(|| json!({"type": "object"})).to_string(),
            })
            .collect(),
        tool_choice: String::new(),
        // OpenAI clients do not count turns: the trace's atomic save still
        // refuses a turn that races another.
        turns_before: None,
        sampling: Some(SamplingParams {
            temperature: request.temperature,
            top_p: request.top_p,
            seed: request.seed,
            max_new_tokens: request.max_completion_tokens.or(request.max_tokens).unwrap_or(0),
            stop,
            ..Default::default()
        }),
        logprobs: request.logprobs,
        run_id: String::new(),
        teacher_reply: String::new(),
        ticket: String::new(),
    })
}

async fn complete(
    state: &AppState,
    headers: &HeaderMap,
    episode: String,
    body: Value,
) -> Result<Json<Value>, ApiError> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let mut chat = chat_request(&episode, body).map_err(ApiError)?;
    chat.ticket = header(TICKET_HEADER).unwrap_or_default().to_owned();
    let logprobs = chat.logprobs;
    let response = state.handlers.turn("http", header("authorization"), chat).await.map_err(ApiError)?;
    let message = response.message.unwrap_or_default();
    let tool_calls: Vec<Value> = message
        .tool_calls
        .iter()
        .map(|call| json!({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}))
        .collect();
    let mut out_message = json!({"role": "assistant", "content": message.content});
    if !tool_calls.is_empty() {
        out_message["tool_calls"] = Value::Array(tool_calls);
    }
    let usage = response.usage.unwrap_or_default();
    let logprobs = logprobs.then(|| {
        json!({"content": response.token_ids.iter().zip(&response.logprobs).map(|(id, lp)| json!({"token_id": id, "logprob": lp})).collect::<Vec<_>>()})
    });
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    Ok(Json(json!({
        "id": format!("chatcmpl-{episode}-{created}"),
        "object": "chat.completion",
        "created": created,
        "model": "sleuth-policy",
        "choices": [{"index": 0, "message": out_message, "finish_reason": response.finish_reason, "logprobs": logprobs}],
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}
        },
        "sleuth": {"policy_version": response.policy_version, "drift": response.drift, "malformed_tool_call": response.malformed_tool_call}
    })))
}

fn sleuth_chat_shorten(text: &str) -> &str {
    match text.char_indices().nth(80) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<f64>().prop_map(|f| json!(f)),
            prop_oneof![Just("user".to_owned()), Just("auto".to_owned()), "\\PC{0,12}"].prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("messages".to_owned()),
                        Just("role".to_owned()),
                        Just("content".to_owned()),
                        Just("tools".to_owned()),
                        Just("function".to_owned()),
                        Just("stop".to_owned()),
                        Just("tool_choice".to_owned()),
                        Just("max_tokens".to_owned()),
                        Just("tool_calls".to_owned()),
                        "[a-z_]{1,8}"
                    ],
                    inner,
                    0..6
                )
                .prop_map(|map| Value::Object(map.into_iter().collect())),
            ]
        })
    }

    #[test]
    fn bodies_become_turns_and_bad_fields_are_named() {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "stop": ["\n"], "max_tokens": 5});
        let chat = chat_request("e", body).unwrap();
        assert_eq!((chat.messages.len(), chat.sampling.unwrap().max_new_tokens), (1, 5));
        let error = chat_request("e", json!({"messages": [{"role": "user", "content": 3}]})).unwrap_err();
        assert!(error.to_string().contains("messages[0].content"), "{error}");
        let error = chat_request("e", json!({"messages": [], "stop": [1]})).unwrap_err();
        assert!(error.to_string().contains("stop[0]"), "{error}");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

        /// Any JSON body: a turn or an InvalidArgument naming what is wrong, never a panic.
        #[test]
        fn any_body_is_a_turn_or_a_named_error(body in json_value(), messages in json_value()) {
            for body in [body.clone(), json!({"messages": messages, "stop": body})] {
                match chat_request("fuzz", body) {
                    Ok(chat) => prop_assert_eq!(chat.episode_id, "fuzz"),
                    Err(error) => prop_assert!(matches!(error, Error::InvalidArgument(_)), "{error}"),
                }
            }
        }
    }
}
