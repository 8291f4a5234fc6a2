//! The orchestrator's web dashboard: read-only HTML pages of the runs it
//! keeps, served on its own HTTP port behind the mesh's token.
//!
//! - `/`: every run ([`runs::list`]);
//! - `/runs/{run}`: a run's curves, validations and episodes ([`runs::show`]);
//! - `/runs/{run}/episodes/{episode}`: one episode, turns and tokens ([`episode::show`]);
//! - `/evaluations`: evaluation reports side by side ([`evaluations::list`]);
//! - `/login`: signing a browser in ([`auth`]).
//!
//! Pages are rendered on the server as HTML with inline SVG charts and no
//! script ([`html`], [`chart`]): nothing to fetch from the internet, one
//! request per page. Long lists are paginated.

pub mod auth;
pub mod chart;
pub mod episode;
pub mod evaluations;
pub mod html;
pub mod records;
pub mod runs;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sleuth_kit::{BearerToken, ErrorKind, ServiceError};
use sleuth_metrics::bootstrap::Interval;
use sleuth_proto::rollout::v1::RunSpec;
use sleuth_store::{Database, StoreError};

use crate::runs::Runner;

/// What the pages read from.
#[derive(Clone)]
pub struct Dashboard {
    /// Runs, their live progress and the run-state tables.
    pub runner: Runner,
    /// The run-state database, for the learner's records and the aggregates.
    pub database: Database,
    /// Where evaluation jobs write their reports.
    pub report_dir: PathBuf,
    /// The model directory whose tokenizer spells out trace tokens when a
    /// run's spec names no local model of its own.
    pub model: Option<PathBuf>,
    /// Tokenizers loaded so far, by file (None: that file could not be read).
    tokenizers: Arc<Mutex<HashMap<PathBuf, Option<Arc<tokenizers::Tokenizer>>>>>,
    /// Bootstrap intervals drawn so far, by report (and reference) file as
    /// written: thousands of resamples per report, and a report changes
    /// only when its job reruns, which changes its time.
    intervals: Arc<Mutex<HashMap<IntervalKey, Drawn>>>,
}

/// A report file as written, and the reference's for a paired interval.
type ReportFile = (PathBuf, std::time::SystemTime);
type IntervalKey = (ReportFile, Option<ReportFile>);
/// An interval with the number of tasks it was drawn over; None: no tasks.
type Drawn = Option<(Interval, usize)>;

impl Dashboard {
    pub fn new(runner: Runner, database: Database, report_dir: PathBuf, model: Option<PathBuf>) -> Self {
        Self { runner, database, report_dir, model, tokenizers: Arc::default(), intervals: Arc::default() }
    }

    /// The interval `draw` makes for `report` (against `reference`), drawn once.
    pub fn interval(&self, report: &ReportFile, reference: Option<&ReportFile>, draw: impl FnOnce() -> Drawn) -> Drawn {
        let key = (report.clone(), reference.cloned());
        if let Some(known) = self.intervals.lock().expect("intervals").get(&key) {
            return *known;
        }
        let drawn = draw();
        self.intervals.lock().expect("intervals").insert(key, drawn);
        drawn
    }

    /// The tokenizer of the model that sampled `spec`'s run: the spec's own
    /// start model when it is a local directory, else the dashboard's.
    pub fn tokenizer(&self, spec: &RunSpec) -> Option<Arc<tokenizers::Tokenizer>> {
        let own =
            spec.policy.as_ref().map(|p| p.model_uri.trim_start_matches("file://")).filter(|u| u.starts_with('/'));
        let file = own.map(PathBuf::from).or_else(|| self.model.clone())?.join("tokenizer.json");
        let mut loaded = self.tokenizers.lock().expect("tokenizers");
        loaded
            .entry(file.clone())
            .or_insert_with(|| match tokenizers::Tokenizer::from_file(&file) {
                Ok(tokenizer) => Some(Arc::new(tokenizer)),
                Err(error) => {
                    tracing::warn!(file = %file.display(), %error, "dashboard: no tokenizer, trace tokens show as ids");
                    None
                }
            })
            .clone()
    }

    /// Every page, behind `token`.
    pub fn router(self, token: Option<BearerToken>) -> axum::Router {
        axum::Router::new()
            .route("/", get(runs::list))
            .route("/runs/{run}", get(runs::show))
            .route("/runs/{run}/episodes/{episode}", get(episode::show))
            .route("/evaluations", get(evaluations::list))
            .route("/login", get(auth::login_form).post(auth::login).with_state(auth::Gate::new(token.clone())))
            .route("/logout", axum::routing::post(auth::logout))
            .with_state(self)
            .layer(axum::middleware::from_fn_with_state(auth::Gate::new(token), auth::require))
            .layer(axum::middleware::from_fn(auth::security_headers))
    }
}

/// `?page=N` of a paginated list (0-based).
#[derive(serde::Deserialize)]
pub struct Paging {
    pub page: Option<u64>,
}

/// Why a page cannot be shown.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    #[error("{0}")]
    NotFound(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ServiceError for PageError {
    fn kind(&self) -> ErrorKind {
        match self {
            PageError::NotFound(_) => ErrorKind::NotFound,
            PageError::Store(error) => error.kind(),
        }
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let status = match self.kind() {
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!(error = %self, "dashboard page failed");
        }
        let body = format!("<h1>{}</h1><p>{}</p>", status, html::escape(&self.to_string()));
        (status, html::page(status.canonical_reason().unwrap_or("error"), &body)).into_response()
    }
}
