//! The `meshgate` command line: `serve` runs a node; the other commands are a
//! client of a running node's HTTP API.

#![forbid(unsafe_code)]

use crate::config::{Config, Overrides};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "meshgate",
    version,
    about = "A multi-tenant gateway node: WASM functions, pub/sub, one middleware chain."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run a node.
    Serve(ServeArgs),
    /// Manage namespaces (operator key).
    #[command(subcommand)]
    Ns(NsCommand),
    /// Operate on a cluster's nodes (operator key).
    #[command(subcommand)]
    Node(NodeCommand),
    /// Manage API keys of a namespace.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Deploy, list, invoke, inspect and delete WASM functions.
    #[command(subcommand)]
    Fn(FnCommand),
    /// Attach hosts to a static site or to upstream instances.
    #[command(subcommand)]
    Deploy(DeployCommand),
    /// Read the namespace's key-value store.
    #[command(subcommand)]
    Kv(KvCommand),
    /// Publish one message to a topic (DATA, or standard input when absent).
    Pub {
        topic: String,
        data: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Subscribe to a topic and print each message's data on its own line.
    Sub {
        topic: String,
        /// Print each message as its JSON frame (topic, data_base64, timestamp,
        /// and offset on a history topic).
        #[arg(long, conflicts_with = "offsets")]
        json: bool,
        /// Print `OFFSET<TAB>DATA` per message (`-` for a message of a topic
        /// without history, which has no offset).
        #[arg(long)]
        offsets: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Print a history topic's kept messages after an offset, oldest first,
    /// each message's data on its own line (docs/pubsub.md "Reading the history").
    History {
        topic: String,
        /// Messages after this offset (default 0: from the oldest kept);
        /// with --reverse, those before it (default: from the newest).
        #[arg(long)]
        since: Option<u64>,
        /// The epoch --since belongs to; the node refuses another (400 BAD_OFFSET).
        #[arg(long)]
        epoch: Option<String>,
        /// Newest first.
        #[arg(long)]
        reverse: bool,
        /// Read one page of at most this many (1 to the node's
        /// `[pubsub] max_recovered_publications`, 300 by default); without
        /// it, every page is followed to the end.
        #[arg(long)]
        limit: Option<u32>,
        /// Print the node's answer as JSON (topic, epoch, offset,
        /// publications with offset, timestamp and data_base64).
        #[arg(long, conflicts_with = "offsets")]
        json: bool,
        /// Print `OFFSET<TAB>DATA` per message.
        #[arg(long)]
        offsets: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show a namespace's quotas and usage; the operator sets them.
    #[command(subcommand)]
    Quotas(QuotasCommand),
    /// Sign in to a namespace with a wallet's Ed25519 key.
    #[command(subcommand)]
    Wallet(WalletCommand),
    /// The sessions (sign-ins) of the credential's own subject in its
    /// namespace: list them, end one (`--end SID`) or every one of a device
    /// (`--device ID`). docs/auth.md "Sessions and devices".
    Sessions {
        /// End this session (its refresh at once, its access tokens within 2 s).
        #[arg(long, conflicts_with = "device")]
        end: Option<String>,
        /// End every session signed in with this device id.
        #[arg(long)]
        device: Option<String>,
        #[command(flatten)]
        page: PageArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// The node's state for its operator (operator key): id, version,
    /// uptime, readiness, store, mesh peers, cluster nodes and breakers,
    /// namespaces running, the fullest mailboxes. Exits 1 when the node is
    /// not ready or cannot be reached.
    Status {
        /// Print the node's answer (`GET /v1/status`) as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
pub enum QuotasCommand {
    /// Each quota's limit and use (the namespace of --key, or -n NAME).
    Show {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Replace the namespace's quota overrides (operator key, -n NAME):
    /// exactly the NAME=VALUE given; a quota not named takes the node's
    /// default again, and none named clears them all.
    Set {
        /// A quota and its limit, e.g. kv_keys=5000 (docs/quotas.md names them).
        #[arg(value_name = "QUOTA=LIMIT")]
        quotas: Vec<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// Where the node is, for a command that sends no credential.
#[derive(Args, Clone)]
pub struct NodeArgs {
    /// Base URL of the node.
    #[arg(long, env = "MESHGATE_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
}

#[derive(Subcommand)]
pub enum WalletCommand {
    /// Ask the node for a challenge, sign it with the key and verify it;
    /// prints the access token (docs/auth.md "Wallet sign-in").
    SignIn {
        /// The namespace to sign in to (it must have enabled wallet sign-in).
        #[arg(long, short = 'n')]
        namespace: String,
        /// The wallet's Ed25519 private key: PKCS#8 in PEM
        /// (`openssl genpkey -algorithm ed25519`) or DER, or the 32-byte
        /// seed as 64 hex characters.
        #[arg(long)]
        key_file: PathBuf,
        /// Sign in with an Ethereum account on this EIP-155 chain (Sign-In
        /// with Ethereum): the key file then holds its secp256k1 private key
        /// as 64 hex characters (`0x` optional).
        #[arg(long)]
        chain_id: Option<u64>,
        /// Print the whole answer as JSON (access and refresh token, expiry, role).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        node: NodeArgs,
    },
    /// Print the wallet address of a key file (its public key as 64 hex
    /// characters), as allow lists name it.
    Address {
        /// The key file, as for `sign-in`.
        #[arg(long)]
        key_file: PathBuf,
        /// The key file holds an Ethereum private key: print its EIP-55 address.
        #[arg(long)]
        evm: bool,
    },
}

#[derive(Args)]
pub struct ServeArgs {
    /// Path of config.toml.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Listen address (host:port).
    #[arg(long)]
    pub listen: Option<String>,
    /// Data folder.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Log format: pretty or json.
    #[arg(long)]
    pub log_format: Option<String>,
}

/// Where the node is and which credential to use.
#[derive(Args, Clone)]
pub struct ClientArgs {
    /// Base URL of the node.
    #[arg(long, env = "MESHGATE_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Credential: an API key, a JWT or the operator key (default: MESHGATE_KEY,
    /// then MESHGATE_OPERATOR_KEY, then ./data/operator.key).
    #[arg(long, env = "MESHGATE_KEY")]
    pub key: Option<String>,
    /// Act on this namespace (operators must name one for namespace routes).
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
}

/// How a list command pages (`GET` listings answer pages with `next_cursor`).
#[derive(Args, Clone, Default)]
pub struct PageArgs {
    /// Print one page of at most this many items (1 to 1000), with its
    /// `next_cursor`; without it, every page is followed and all items printed.
    #[arg(long)]
    pub limit: Option<u32>,
    /// Start after this `next_cursor` of an earlier page.
    #[arg(long)]
    pub cursor: Option<String>,
    /// Items asked for per request while following every page (default: the node's page size).
    #[arg(long)]
    pub page_size: Option<u32>,
}

#[derive(Subcommand)]
pub enum KvCommand {
    /// List the namespace's keys, in order.
    List {
        /// Only keys starting with this.
        #[arg(long, default_value = "")]
        prefix: String,
        #[command(flatten)]
        page: PageArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
pub enum NsCommand {
    /// Create a namespace; prints its first owner API key.
    Create {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List namespaces.
    List {
        #[command(flatten)]
        page: PageArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a namespace and all its data.
    Delete {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
pub enum NodeCommand {
    /// Move every namespace off node ID and close its sockets (4012:
    /// reconnect); prints the namespaces moved.
    Drain {
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
pub enum KeysCommand {
    /// Create an API key; prints it once.
    Create {
        /// Role: owner, admin, developer, runtime, reader.
        #[arg(long)]
        role: Option<String>,
        /// Key kind: `sk` (control plane) or `rk` (data plane, to embed in
        /// an app). Default: the role's (`rk` for runtime, `sk` for the
        /// others and for a key of grants only); a kind the role does not
        /// pair with is refused.
        #[arg(long)]
        kind: Option<String>,
        /// Explicit grant (domain:action:resource), repeatable.
        #[arg(long = "grant")]
        grants: Vec<String>,
        /// Days until it expires (default 90, at most 365).
        #[arg(long)]
        days: Option<u64>,
        /// A name to recognise it by.
        #[arg(long, default_value = "")]
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the namespace's keys (never the secrets).
    List {
        #[command(flatten)]
        page: PageArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Revoke a key by id.
    Revoke {
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => serve(args),
        other => crate::cli_client::run(other),
    }
}

/// Logs to stderr through a writer thread (see [`log_sink`]): a request's
/// log line is appended to a shared buffer, not written by the worker that
/// served it, and the thread writes what gathered every few milliseconds.
/// The returned guard writes what is left when it is dropped, at exit.
fn init_logging(format: &str) -> std::io::Result<log_sink::Guard> {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,libp2p_gossipsub=error"));
    let (writer, guard) = log_sink::start(std::io::stderr())?;
    // The request log's lines are built by hand (docs/decisions.md "The
    // request log") and go to the same writer.
    let access = writer.clone();
    crate::node::install_request_log(format == "json", move |line| access.append(line));
    // Colours only for a person at a terminal: a log file or a collector
    // gets plain text (the escape codes also cost about 5% of a request's
    // CPU, written into every line's fields).
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .with_writer(writer);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
    Ok(guard)
}

fn serve(args: ServeArgs) -> ExitCode {
    let env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("MESHGATE_"))
        .collect();
    let overrides = Overrides {
        listen: args.listen,
        data_dir: args.data_dir,
        log_format: args.log_format,
    };
    let config = match Config::load(args.config.as_deref(), &env, &overrides) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("meshgate: {e}");
            return ExitCode::from(2);
        }
    };
    let _log = match init_logging(&config.server.log_format) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("meshgate: cannot start the log writer thread: {e}");
            return ExitCode::from(1);
        }
    };
    let system = actix_web::rt::System::new();
    let result = system.block_on(async move {
        let running = crate::node::start(config).await?;
        // Scripts and tests read this line to find the bound port.
        let scheme = if running.node.config.tls.cert_file.is_empty() {
            "http"
        } else {
            "https"
        };
        if let Some(m) = running.metrics_addr {
            println!("meshgate metrics on http://{m}/metrics");
        }
        if let Some(g) = running.grpc_addr {
            println!("meshgate gRPC on {g}");
        }
        println!("meshgate listening on {scheme}://{}", running.addr);
        tracing::info!(addr = %running.addr, "Listening.");
        running.run_until_signal().await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshgate: {e:#}");
            // A start that failed after its listeners were bound (a store it
            // may not adopt, say) leaves the node supervisor's task behind;
            // dropping the runtime would cancel it outside a reactor, and its
            // timers panic then, after the clear message. The process ends
            // here anyway.
            std::mem::forget(system);
            ExitCode::from(1)
        }
    }
}

/// The routes' default policy of `deploy static` and `deploy upstream`
/// (docs/deployments.md "Route policy").
#[derive(Args, Clone, Default)]
pub struct PolicyArgs {
    /// The routes' default policy: which credential they take (none, api_key, jwt, any).
    #[arg(long)]
    pub auth: Option<String>,
    /// A grant the credential must hold (repeat for several; all are needed).
    #[arg(long = "require-grant")]
    pub require_grants: Vec<String>,
    /// Send the credential on to the upstream (removed by default).
    #[arg(long)]
    pub forward_credentials: bool,
    /// The whole default policy as JSON (docs/deployments.md "Route policy");
    /// --auth, --require-grant and --forward-credentials are set on top of it.
    #[arg(long)]
    pub policy: Option<String>,
}

#[derive(Subcommand)]
pub enum DeployCommand {
    /// Pack DIR into a .tar.gz and serve it as a static site on the hosts.
    Static {
        dir: PathBuf,
        /// Host to serve (repeat for several).
        #[arg(long = "host", required = true)]
        hosts: Vec<String>,
        /// Deployment name (default: the folder's name).
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        policy: PolicyArgs,
        /// `auto`: the hosts' certificate is issued by ACME (the node needs `[tls.acme]`).
        #[arg(long, value_name = "auto")]
        tls: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Proxy the hosts to one or more http(s)://host:port instances.
    Upstream {
        #[arg(required = true)]
        urls: Vec<String>,
        /// Host to serve (repeat for several).
        #[arg(long = "host", required = true)]
        hosts: Vec<String>,
        /// Deployment name (default: the first host with dots as dashes).
        #[arg(long)]
        name: Option<String>,
        /// Routes as JSON: [{"path_prefix","methods","strip_prefix","add_prefix","priority","policy"}].
        #[arg(long)]
        routes: Option<String>,
        #[command(flatten)]
        policy: PolicyArgs,
        /// An instance's weight as URL=WEIGHT, 1..=1000 (repeat; default 1).
        /// `URL=WEIGHT` also works in the instance list itself.
        #[arg(long = "weight", value_name = "URL=WEIGHT")]
        weights: Vec<String>,
        /// round_robin (default, weighted), least_request or hash.
        #[arg(long)]
        balance: Option<String>,
        /// The header `hash` balancing hashes (default: the client address); implies --balance hash.
        #[arg(long)]
        hash_header: Option<String>,
        /// Turn on active health checks: GET this absolute path on each instance.
        #[arg(long)]
        health_path: Option<String>,
        /// Between two checks, in ms (at least 100; default 5000).
        #[arg(long, requires = "health_path")]
        health_interval_ms: Option<u64>,
        /// Limit on one check, in ms (default 1000).
        #[arg(long, requires = "health_path")]
        health_timeout_ms: Option<u64>,
        /// Passes in a row that bring an instance back (default 2).
        #[arg(long, requires = "health_path")]
        healthy_threshold: Option<u32>,
        /// Failures in a row that take an instance out (default 3).
        #[arg(long, requires = "health_path")]
        unhealthy_threshold: Option<u32>,
        /// Never gzip the upstream's answers (by default the node gzips
        /// compressible ones the upstream did not encode, for clients that accept it).
        #[arg(long)]
        no_compress: bool,
        /// The cap on a gRPC call's deadline, in ms (`upstream.grpc.max_timeout_ms`).
        #[arg(long)]
        grpc_max_timeout_ms: Option<u64>,
        /// `auto`: the hosts' certificate is issued by ACME (the node needs `[tls.acme]`).
        #[arg(long, value_name = "auto")]
        tls: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the namespace's deployments.
    List {
        #[command(flatten)]
        page: PageArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show a deployment with its instances' health.
    Show {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// The deployment's latest requests on the node that answers (newest first).
    Activity {
        name: String,
        /// How many (1 to 256; default 50).
        #[arg(long)]
        limit: Option<u32>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Make an earlier version serve again (default: the one before the active one).
    Rollback {
        name: String,
        #[arg(long)]
        version: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a deployment and release its hosts.
    Delete {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// The deployment's own TLS certificate for its hosts: upload it with
    /// --cert and --private-key, show it (no flags), or --remove it.
    Cert {
        name: String,
        /// PEM certificate chain, leaf first.
        #[arg(long, requires = "private_key", conflicts_with = "remove")]
        cert: Option<PathBuf>,
        /// PEM private key of the leaf (`--key` is the credential, as in
        /// every command).
        #[arg(long, requires = "cert", conflicts_with = "remove")]
        private_key: Option<PathBuf>,
        /// Remove it: the hosts get the node's own certificate.
        #[arg(long)]
        remove: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
pub enum FnCommand {
    /// Deploy a WASM module as the function's next version.
    Deploy {
        /// The `.wasm` file (WAT text is accepted too).
        file: PathBuf,
        /// Function name.
        #[arg(long)]
        name: String,
        /// Memory limit in MiB (1-256, default 64).
        #[arg(long = "memory-mb")]
        memory_mb: Option<u32>,
        /// Timeout in seconds (1-60, default 10).
        #[arg(long)]
        timeout: Option<u32>,
        /// Anyone may invoke it on /v1/invoke/{namespace}/{name}.
        #[arg(long)]
        public: bool,
        /// Metadata JSON: env_vars, pubsub_topics, cron.
        #[arg(long)]
        metadata: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the namespace's functions.
    List {
        #[command(flatten)]
        page: PageArgs,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Invoke a function (NAME or NAME@VERSION) with DATA, or standard input when absent; prints its output.
    Invoke {
        name: String,
        data: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show a function's newest invocation records.
    Logs {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a function and its versions.
    Delete {
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// The node's log sink. One `write` per line on an unbuffered stderr cost
/// about 15% of a KV read's CPU, and a writer thread woken per line (a
/// channel) still cost a wake-up per request: here lines are appended to a
/// shared buffer under a lock held for a copy, and a thread writes the
/// buffer every [`INTERVAL`](log_sink::INTERVAL), or sooner when it passes
/// [`SOON`](log_sink::SOON). When it finds nothing to write it sleeps until
/// the next line (an idle node's writer used to wake every interval, 100
/// times a second). Nothing is dropped: a logging thread waits only
/// when the buffer holds [`MAX_PENDING`](log_sink::MAX_PENDING) bytes the
/// writer has not taken yet.
mod log_sink {
    use parking_lot::{Condvar, Mutex};
    use std::io::Write;
    use std::sync::Arc;
    use std::time::Duration;

    /// Longest a line waits in the buffer.
    pub const INTERVAL: Duration = Duration::from_millis(10);
    /// Buffered bytes past which the writer is woken at once.
    pub const SOON: usize = 256 << 10;
    /// Buffered bytes past which a logging thread waits for the writer.
    pub const MAX_PENDING: usize = 16 << 20;

    #[derive(Default)]
    struct Pending {
        /// Lines not written yet, in order.
        buf: Vec<u8>,
        /// Set by the guard: the writer writes what is left and stops.
        closing: bool,
        /// The writer found nothing to write and sleeps until a line comes.
        idle: bool,
        /// Times the writer took the buffer (for the tests).
        rounds: u64,
    }

    #[derive(Default)]
    struct Shared {
        /// The buffer and the stop flag.
        pending: Mutex<Pending>,
        /// Wakes the writer early: the buffer is large, or the sink closes.
        wake: Condvar,
        /// Wakes logging threads waiting for room.
        room: Condvar,
    }

    /// What `tracing_subscriber` writes each formatted event into.
    #[derive(Clone)]
    pub struct Sink(Arc<Shared>);

    /// Writes what is left and stops the writer thread when dropped.
    pub struct Guard {
        /// The state shared with the sink and the writer thread.
        shared: Arc<Shared>,
        /// The writer thread, joined on drop.
        thread: Option<std::thread::JoinHandle<()>>,
    }

    /// Starts the writer thread over `out`. Without it the buffer would only
    /// fill and then hold every logging thread: a thread that cannot be
    /// started is an error at start-up.
    pub fn start<W: Write + Send + 'static>(out: W) -> std::io::Result<(Sink, Guard)> {
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("log-writer".into())
            .spawn(move || writer(&s, out))?;
        Ok((
            Sink(shared.clone()),
            Guard {
                shared,
                thread: Some(thread),
            },
        ))
    }

    fn writer<W: Write>(shared: &Shared, mut out: W) {
        let mut taken = Vec::new();
        loop {
            let closing = {
                let mut p = shared.pending.lock();
                if p.buf.is_empty() && !p.closing {
                    // Nothing to write: sleep until the next line.
                    p.idle = true;
                    while p.idle && !p.closing {
                        shared.wake.wait(&mut p);
                    }
                }
                // Then linger, so that one write carries many lines.
                if p.buf.len() < SOON && !p.closing {
                    shared.wake.wait_for(&mut p, INTERVAL);
                }
                std::mem::swap(&mut p.buf, &mut taken);
                p.rounds += 1;
                p.closing
            };
            shared.room.notify_all();
            if !taken.is_empty() {
                // A log that cannot be written has nowhere to report it.
                let _ = out.write_all(&taken).and_then(|()| out.flush());
                taken.clear();
            }
            if closing {
                return;
            }
        }
    }

    impl Sink {
        /// Appends `line` to the buffer (waiting for room when it is full).
        pub fn append(&self, line: &[u8]) {
            let mut p = self.0.pending.lock();
            while p.buf.len() >= MAX_PENDING && !p.closing {
                self.0.room.wait(&mut p);
            }
            p.buf.extend_from_slice(line);
            if p.idle || p.buf.len() >= SOON {
                p.idle = false;
                self.0.wake.notify_one();
            }
        }
    }

    impl Write for Sink {
        fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
            self.append(line);
            Ok(line.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Sink {
        type Writer = Sink;
        fn make_writer(&'a self) -> Sink {
            self.clone()
        }
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            self.shared.pending.lock().closing = true;
            self.shared.wake.notify_one();
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// A `Write` the test can read back.
        #[derive(Clone, Default)]
        struct Captured(Arc<Mutex<Vec<u8>>>);
        impl Write for Captured {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }

        /// The writer sleeps while there is nothing to write (no round
        /// without a line), and a line logged after a quiet spell still
        /// reaches the output.
        #[test]
        fn an_idle_writer_sleeps_until_a_line_comes() {
            let out = Captured::default();
            let (mut sink, guard) = start(out.clone()).unwrap();
            let written = |n: usize| {
                for _ in 0..500 {
                    if out.0.lock().len() >= n {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                panic!("{n} bytes never written");
            };
            sink.write_all(b"one\n").unwrap();
            written(4);
            let rounds = guard.shared.pending.lock().rounds;
            // Twenty intervals with nothing logged: no round taken.
            std::thread::sleep(INTERVAL * 20);
            assert_eq!(guard.shared.pending.lock().rounds, rounds);
            sink.write_all(b"two\n").unwrap();
            written(8);
            assert_eq!(guard.shared.pending.lock().rounds, rounds + 1);
            drop(guard);
            assert_eq!(&out.0.lock()[..], b"one\ntwo\n");
        }

        /// Every line reaches the output, in order, from several threads,
        /// past the buffer's waiting bound; the guard writes what is left.
        #[test]
        fn every_line_is_written_in_order() {
            let out = Captured::default();
            let (sink, guard) = start(out.clone()).unwrap();
            let line = vec![b'x'; 4096];
            let threads: Vec<_> = (0..2u8)
                .map(|t| {
                    let mut s = sink.clone();
                    let mut l = line.clone();
                    l[0] = b'a' + t;
                    std::thread::spawn(move || {
                        for i in 0..(MAX_PENDING / 4096 + 100) as u32 {
                            let mut l = l.clone();
                            l[1..5].copy_from_slice(&i.to_be_bytes());
                            s.write_all(&l).unwrap();
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            drop(guard);
            let got = out.0.lock();
            let n = MAX_PENDING / 4096 + 100;
            assert_eq!(got.len(), 2 * n * 4096);
            for t in 0..2u8 {
                let seq: Vec<u32> = got
                    .chunks(4096)
                    .filter(|c| c[0] == b'a' + t)
                    .map(|c| u32::from_be_bytes([c[1], c[2], c[3], c[4]]))
                    .collect();
                assert_eq!(seq, (0..n as u32).collect::<Vec<_>>(), "thread {t}");
            }
        }
    }
}
