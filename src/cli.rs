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
    /// Manage API keys of a namespace.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Deploy, list, invoke, inspect and delete WASM functions.
    #[command(subcommand)]
    Fn(FnCommand),
    /// Attach hosts to a static site or to upstream instances.
    #[command(subcommand)]
    Deploy(DeployCommand),
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
        /// Print each message as its JSON frame (topic, data_base64, timestamp).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
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
pub enum KeysCommand {
    /// Create an API key; prints it once.
    Create {
        /// Role: owner, admin, developer, runtime, reader.
        #[arg(long)]
        role: Option<String>,
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

/// Logs to stderr through a writer thread: a request's log line is queued,
/// not written by the worker that served it (one `write` per line on an
/// unbuffered stderr cost about 15% of a KV read's CPU). Nothing is dropped:
/// a worker waits only if the thread falls 128k lines behind. The returned
/// guard flushes what is queued when it is dropped, at exit.
fn init_logging(format: &str) -> tracing_appender::non_blocking::WorkerGuard {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,libp2p_gossipsub=error"));
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .thread_name("log-writer")
        .finish(std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
    guard
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
    let _log = init_logging(&config.server.log_format);
    let system = actix_web::rt::System::new();
    let result = system.block_on(async move {
        let running = crate::node::start(config).await?;
        // Scripts and tests read this line to find the bound port.
        let scheme = if running.node.config.tls.cert_file.is_empty() {
            "http"
        } else {
            "https"
        };
        println!("meshgate listening on {scheme}://{}", running.addr);
        tracing::info!(addr = %running.addr, "Listening.");
        running.run_until_signal().await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshgate: {e:#}");
            ExitCode::from(1)
        }
    }
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
        /// Routes as JSON: [{"path_prefix","methods","strip_prefix","add_prefix","priority"}].
        #[arg(long)]
        routes: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the namespace's deployments.
    List {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show a deployment with its instances' health.
    Show {
        name: String,
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
