//! Support for cross-service tests: start the real service binaries as a
//! user would, on ephemeral loopback ports, and stop them with signals.

pub mod fixture;
pub mod helm;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The six services, in an order where each one's upstreams start first.
pub const SERVICES: [&str; 6] =
    ["tool-gateway", "policy-server", "learner", "rollout-orchestrator", "inference-gateway", "agent"];

/// The ticket key of every test mesh (`SLEUTH_TICKET_KEY` of each process):
/// the orchestrator issues episode tickets and the inference gateway checks
/// them in every cross-service test, as in a deployment.
pub const TICKET_KEY: &str = "test-mesh-ticket-key";

/// `request` with the ticket a test mesh's orchestrator would issue it (for
/// a test that calls an agent itself).
pub fn ticketed(mut request: sleuth_proto::agent::v1::RunEpisodeRequest) -> sleuth_proto::agent::v1::RunEpisodeRequest {
    let key = sleuth_kit::ticket::TicketKey::new(TICKET_KEY.parse().expect("a visible-ASCII key"));
    request.ticket = agent::ticket::issue(&key, &request);
    request
}

/// A service binary running as a child process.
pub struct ServiceProcess {
    pub name: &'static str,
    /// Address it listens on, from its "listening" log line.
    pub addr: String,
    /// Its HTTP address (`http://` + this): the orchestrator's dashboard or
    /// the inference gateway's OpenAI-compatible door, from its "dashboard
    /// listening" or "openai-compatible http listening" log line; None for
    /// the other services.
    pub http: Option<String>,
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl ServiceProcess {
    /// Starts `name` listening on an ephemeral loopback port, with JSON logs
    /// and the given extra environment, and waits for its "listening" line.
    pub fn start(name: &'static str, env: &[(&str, String)]) -> Result<Self> {
        let binary = binary(name)?;
        let mut child = Command::new(&binary)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("SLEUTH_LISTEN", "127.0.0.1:0")
            // On loopback; a test that gives a token authenticates anyway.
            .env("SLEUTH_INSECURE", "true")
            .env("SLEUTH_TICKET_KEY", TICKET_KEY)
            // The HTTP port of the services that have one (the orchestrator's dashboard).
            .env("SLEUTH_HTTP_LISTEN", "127.0.0.1:0")
            .env("SLEUTH_LOG_FORMAT", "json")
            .env("SLEUTH_LOG", "info")
            // One libtorch thread per process (policy server, learner): a
            // test's processes share two cores with another test's, and
            // intra-op threads that wait on each other for a core slow a
            // loaded machine's tests several times over. The Kubernetes
            // rollout test beside four CPU hogs: 48 to 58 s with a thread
            // per core, 8 to 11 s with one (4 s idle either way).
            .env("SLEUTH_TORCH_THREADS", "1")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let stderr = child.stderr.take().expect("stderr is piped");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (addr_tx, addr_rx) = mpsc::channel();
        let lines = log.clone();
        let http = Arc::new(Mutex::new(None));
        let http_addr = http.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = listening_addr(&line, "listening") {
                    let _ = addr_tx.send(addr);
                } else if let Some(addr) = ["dashboard listening", "openai-compatible http listening"]
                    .into_iter()
                    .find_map(|message| listening_addr(&line, message))
                {
                    *http_addr.lock().unwrap() = Some(addr);
                }
                lines.lock().unwrap().push(line);
            }
        });
        match addr_rx.recv_timeout(Duration::from_secs(60)) {
            // The HTTP port binds before the gRPC port, so its line came first.
            Ok(addr) => Ok(Self { name, addr, http: http.lock().unwrap().clone(), child, log }),
            Err(_) => {
                let _ = child.kill();
                bail!("{name} did not log that it was listening; log:\n{}", log.lock().unwrap().join("\n"))
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the service logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// SIGKILL: the process dies mid-work, as on a node failure.
    pub fn kill(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// Sends `signal` (a name `kill` knows: STOP, CONT, TERM).
    pub fn signal(&self, signal: &str) -> Result<()> {
        let status = Command::new("kill").args([&format!("-{signal}"), &self.pid().to_string()]).status()?;
        anyhow::ensure!(status.success(), "kill -{signal} {} failed", self.pid());
        Ok(())
    }

    /// Sends SIGTERM and waits (up to `limit`) for the process to exit.
    pub fn terminate(&mut self, limit: Duration) -> Result<(ExitStatus, Duration)> {
        self.signal("TERM")?;
        self.wait(limit)
    }

    /// Waits (up to `limit`) for the process to exit by itself.
    pub fn wait(&mut self, limit: Duration) -> Result<(ExitStatus, Duration)> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok((status, started.elapsed()));
            }
            if started.elapsed() > limit {
                let _ = self.child.kill();
                bail!("{} still running after {limit:?}; log:\n{}", self.name, self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `addr` field of the kit's JSON "listening" log line.
fn listening_addr(line: &str, message: &str) -> Option<String> {
    let record: serde_json::Value = serde_json::from_str(line).ok()?;
    let fields = record.get("fields")?;
    (fields.get("message")?.as_str()? == message).then(|| fields.get("addr")?.as_str().map(str::to_owned))?
}

/// Path of a workspace binary: test executables live in `target/<profile>/deps`,
/// binaries (the fixtures builder among them) in `target/<profile>`.
/// `cargo build --workspace` must have built them.
pub fn binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no parent directory")?;
    let dir = if dir.ends_with("deps") { dir.parent().context("deps has no parent directory")? } else { dir };
    let path = dir.join(name);
    anyhow::ensure!(path.is_file(), "{} not built; run `make build` (cargo build --workspace)", path.display());
    Ok(path)
}
