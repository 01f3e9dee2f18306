//! The command line, as given (clap parses and checks shapes only; commands
//! resolve and validate the rest).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use evalfleet_mock::MockSettings;

/// The version and the commit it was built from (build.rs): `0.1.0
/// (3fa2c1d)`, `0.1.0 (3fa2c1d-dirty)`, or `0.1.0 (unknown)` when built
/// outside a git checkout.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("EVALFLEET_COMMIT"),
    ")"
);

/// Run large LLM evaluation and batch-inference jobs across a fleet of
/// OpenAI-compatible endpoints, durably and fast.
///
/// Exit codes: 0 every item done; 1 the run finished with failed items (or an
/// unexpected error); 2 bad usage, config or input; 130 interrupted (resumable).
#[derive(Debug, Parser)]
#[command(name = "evalfleet", version = VERSION, propagate_version = true)]
pub struct Cli {
    /// More logging (-v debug, -vv trace). EVALFLEET_LOG (e.g.
    /// `info,evalfleet_fleet=debug`) overrides it.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Answer every item of a dataset over the configured endpoints and store the results.
    ///
    /// The run is registered in the store first (every item with its id), then
    /// answered with as many calls in flight as the endpoints allow. Ctrl-C stops
    /// taking items, lets calls in flight finish (up to `shutdown_grace`) and marks
    /// the run interrupted; `evalfleet resume RUN_ID` finishes it.
    #[command(
        after_help = "Example:\n  evalfleet run examples/quickstart.yaml\n  evalfleet run eval.yaml --n-sample 200 --seed 1 --store runs/test.db"
    )]
    Run(RunArgs),

    /// Finish an interrupted or crashed run: every item not yet done is answered, each exactly once.
    ///
    /// The stored config is used (API keys are read again from the environment);
    /// --config gives a new one, whose endpoints and concurrency may differ but
    /// whose dataset and task must not.
    #[command(
        after_help = "Example:\n  evalfleet resume quickstart-20261122-101500-3fa2\n  evalfleet resume RUN_ID --retry-failed --config eval-more-gpus.yaml"
    )]
    Resume(ResumeArgs),

    /// Work on runs of a shared store (PostgreSQL) from this machine: join a run, or wait for runs and join each.
    ///
    /// Each worker claims items for a lease, renews it while it works and
    /// commits their results under it; a worker that dies loses only its
    /// leases, which others take over once they run out. Every item gets
    /// exactly one result, whichever workers answer it. The run's dataset
    /// must be readable here at the path it was registered with. Without
    /// --run, the worker joins each running run with items left, newest
    /// first, and waits for the next until stopped (Ctrl-C or SIGTERM).
    #[command(
        after_help = "Example:\n  evalfleet worker --store postgres://evals@db.internal/evals\n  evalfleet worker --store postgres://evals@db.internal/evals --run gsm8k-20261126-101500-3fa2 --endpoints local-engines.yaml"
    )]
    Worker(WorkerArgs),

    /// Simulate conversation episodes (a config with task.kind: conversation): a run like any other, then rewards, strategies and logs.
    ///
    /// Each episode is an item: personas, relation scorer, policy and robot
    /// are calls over the fleet. Prints total and mean reward, interventions,
    /// the strategy distribution and the stabilisation rate, and writes
    /// conversation_summary.jsonl, batch_summary.jsonl, metrics.jsonl, run_events.jsonl and
    /// config.json to RUN_ID/ beside the store. `compare RUN_A RUN_B` puts two
    /// policies side by side.
    #[command(
        after_help = "Example:\n  evalfleet simulate examples/conversation.yaml --sessions 20 --max-steps 3\n  evalfleet compare RUN_FIXED RUN_MODEL"
    )]
    Simulate(SimulateArgs),

    /// Serve a conversation run as an RL environment: a trainer takes each decision over HTTP (reset, step).
    ///
    /// Prints the server's address. POST /v1/reset gives an episode at its
    /// first decision ({env_id, observation, info}; the observation's
    /// `prompt` is the policy's chat messages); POST /v1/step with {env_id,
    /// action} (1 validate, 2 bridge, 3 plan, 4 no_intervention, or
    /// "invalid") gives {observation, reward, terminated, truncated, info};
    /// POST /v1/close with {env_id} gives an episode up. The personas and the
    /// scorer run on the config's endpoints meanwhile; the run is stored like
    /// any other, and its logs (batch_summary.jsonl, metrics.jsonl,
    /// run_events.jsonl) are written as episodes end. It serves until Ctrl-C
    /// (--exit-when-done: until every episode has ended); --resume RUN_ID
    /// serves what a stopped one left. examples/gym_client.py wraps it as a
    /// Gymnasium Env, examples/trl_rollout.py drives it as a PPO rollout.
    #[command(
        after_help = "Example:\n  evalfleet env examples/conversation.yaml --sessions 1000 --envs 16 --bind 127.0.0.1:8765\n  evalfleet env --resume talk-20261126-101500-3fa2 --bind 127.0.0.1:8765"
    )]
    Env(EnvArgs),

    /// Convert a config of the original Python conversation system (config.local.yaml) to an evalfleet config.
    ///
    /// Writes YAML (to --output, else stdout) with comments saying where each
    /// part came from, and names on stderr every key of the original that has
    /// no place here, with its line and why. Environment variables override
    /// the file as they do in the original (OLLAMA_BASES, AZURE_ENDPOINT,
    /// HUMAN_MODEL, ...); the Azure key stays a reference, ${AZURE_API_KEY}.
    /// `run`, `simulate`, `env` and `check` read such a file directly too.
    #[command(
        after_help = "Example:\n  evalfleet convert app/config.local.yaml -o conversation.yaml\n  evalfleet simulate app/config.local.yaml --sessions 5"
    )]
    Convert(ConvertArgs),

    /// List the runs in a store.
    #[command(after_help = "Example:\n  evalfleet runs --store runs/evalfleet.db")]
    Runs(StoreArgs),

    /// Summarise a run: items by state, attempts and latency per endpoint, events (works while it runs).
    #[command(
        after_help = "Example:\n  evalfleet status quickstart-20261122-101500-3fa2\n  evalfleet status RUN_ID --json"
    )]
    Status(StatusArgs),

    /// Write a run's results as JSONL or CSV, in dataset order.
    #[command(
        after_help = "Example:\n  evalfleet export RUN_ID --format jsonl -o results.jsonl\n  evalfleet export RUN_ID --format csv > results.csv"
    )]
    Export(ExportArgs),

    /// Write a run's stored results to its Google Sheet where the sheet lacks them.
    ///
    /// For a run whose dataset is a sheet with `dataset.sheet.write`: reads
    /// the sheet, and writes each stored result whose cells do not hold its
    /// values yet, into rows that still hold the item the run read. Exits 1
    /// when some rows had changed and were not written.
    #[command(after_help = "Example:\n  evalfleet sync RUN_ID")]
    Sync(SyncArgs),

    /// Validate a config and probe every endpoint (reachable, models served, latency).
    #[command(after_help = "Example:\n  evalfleet check examples/quickstart.yaml")]
    Check(CheckArgs),

    /// List the metric registry: the built-in metrics and, with a config, its metric backends' metrics.
    ///
    /// Each metric's name, backend (`native` for the built-in ones), version,
    /// the key its scores are stored under, its parameters, whether higher is
    /// better, and what it measures. A task names one `NAME`, `NAME@VERSION`,
    /// `NAME@BACKEND` or `NAME@BACKEND@VERSION`.
    #[command(after_help = "Example:\n  evalfleet metrics\n  evalfleet metrics eval.yaml --json")]
    Metrics(MetricsArgs),

    /// Add an endpoint to a running run, or take one out (its calls in flight move to the others).
    ///
    /// The endpoint must be one of the run's configured endpoints; the running
    /// process applies the change within a second.
    #[command(
        after_help = "Example:\n  evalfleet fleet add RUN_ID gpu2\n  evalfleet fleet remove RUN_ID azure"
    )]
    Fleet(FleetArgs),

    /// Parse, check and score a run's stored answers again, without calling any model.
    ///
    /// Uses the run's stored config, or the task's parse/schema/metrics from
    /// --config (which then become the run's); --metrics recomputes only those
    /// metrics and keeps the others' stored scores.
    #[command(
        after_help = "Example:\n  evalfleet score RUN_ID --config eval-with-f1.yaml\n  evalfleet score RUN_ID --metrics exact_match"
    )]
    Score(ScoreArgs),

    /// Report a run's scores overall and by category, with uncertainty, and its per-endpoint telemetry.
    ///
    /// Prints a table and writes metrics_summary.csv, metrics_detailed.csv and
    /// summary.json (under reports/RUN_ID/ beside the store, or --out); with
    /// --html, one self-contained page with the same report for sharing.
    #[command(
        after_help = "Example:\n  evalfleet report RUN_ID\n  evalfleet report RUN_ID --by subject,level --out reports/gsm8k\n  evalfleet report RUN_ID --html report.html"
    )]
    Report(ReportArgs),

    /// Put runs side by side: per metric and category, each against the first, paired on the same items.
    #[command(
        after_help = "Example:\n  evalfleet compare RUN_A RUN_B\n  evalfleet compare RUN_A RUN_B RUN_C --by category --json"
    )]
    Compare(CompareArgs),

    /// Show or empty the response cache of a store.
    #[command(
        after_help = "Example:\n  evalfleet cache stats\n  evalfleet cache clear --store runs/shared.db"
    )]
    Cache(CacheArgs),

    /// Run a benchmark matrix: every model on every dataset (at every sweep point), one model's engine loaded at a time.
    ///
    /// For each model in turn: its engine is started and waited for, its
    /// cells run as ordinary runs (ids NAME-MODEL-DATASET[-cN]), then the
    /// engine is stopped and its GPU memory waited for before the next model.
    /// Run the same command again after a crash or Ctrl-C: only unfinished
    /// cells run, and only their unfinished items. `bench status` shows each
    /// cell; `bench report` compares the models.
    #[command(
        after_help = "Example:\n  evalfleet bench examples/bench.yaml\n  evalfleet bench status examples/bench.yaml\n  evalfleet bench report matrix-demo --format csv\n  evalfleet bench report examples/bench.yaml --html bench.html"
    )]
    Bench(BenchArgs),

    /// Write a commented starter config for an endpoint kind and a task kind, with a tiny dataset beside it.
    ///
    /// Writes FILE, FILE's stem + `-items.jsonl` (the dataset; a
    /// conversation has none) and, with the mock, `-answers.jsonl` (its
    /// scripted replies). With `--endpoint mock`
    /// the config runs as written; with the others, the lines marked EDIT
    /// name a server, host or model of yours first. Existing files are left
    /// alone unless --force.
    #[command(
        after_help = "Example:\n  evalfleet init && evalfleet run evalfleet.yaml\n  evalfleet init --endpoint external --task json -o evals/extract.yaml"
    )]
    Init(InitArgs),

    /// Print a shell's completion script for evalfleet.
    #[command(
        after_help = "Example:\n  evalfleet completions bash > ~/.local/share/bash-completion/completions/evalfleet\n  evalfleet completions zsh > ~/.zfunc/_evalfleet"
    )]
    Completions(CompletionsArgs),

    /// Write man pages: evalfleet.1 and one page per command (evalfleet-run.1, ...).
    #[command(after_help = "Example:\n  evalfleet man -o ~/.local/share/man/man1")]
    Man(ManArgs),

    /// Run one engine command so that it never outlives its run (internal).
    #[command(hide = true)]
    Supervise(SuperviseArgs),

    /// Serve the HTTP API and dashboard over a store: start, watch, explore and compare runs.
    ///
    /// Listens on 127.0.0.1:8080 unless --bind says otherwise; any address but
    /// a loopback one needs an API key (EVALFLEET_API_KEY), which every request
    /// then carries (X-API-Key or Authorization: Bearer). Prints the address.
    /// Runs started from the API are answered in this process; Ctrl-C stops
    /// them (resumable) and the server.
    #[command(
        after_help = "Example:\n  evalfleet serve\n  EVALFLEET_API_KEY=... evalfleet serve --bind 0.0.0.0:8080 --store runs/team.db --allow-root configs/"
    )]
    Serve(ServeArgs),

    /// Serve the built-in OpenAI-compatible mock endpoint; prints the address it listens on.
    #[command(
        after_help = "Example:\n  evalfleet mock --bind 127.0.0.1:8000 --latency 200ms --error-rate 0.05\n  evalfleet mock --rpm 600 --output-tokens 64 --itl 10ms"
    )]
    Mock(MockArgs),
}

impl Command {
    /// Whether the command only reads and prints (so a reader that stops
    /// early may end it quietly).
    pub fn only_prints(&self) -> bool {
        matches!(
            self,
            Self::Runs(_)
                | Self::Status(_)
                | Self::Export(_)
                | Self::Report(_)
                | Self::Compare(_)
                | Self::Convert(_)
                | Self::Completions(_)
        )
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum InitEndpoint {
    /// The built-in mock, started inside the run: runs as written.
    Mock,
    /// An OpenAI-compatible server someone else runs, at a base URL.
    External,
    /// An engine (vLLM, SGLang, llama.cpp, Ollama) started on this machine.
    Local,
    /// An engine started on another host over SSH.
    Remote,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum InitTask {
    /// One call per item, the answer scored by exact match.
    Chat,
    /// The answer parsed as JSON, checked against a schema, scored field by field.
    Json,
    /// The answer a program, judged against the item's tests in the sandbox.
    Code,
    /// Simulated three-person conversations with a robot that may intervene (no dataset: episodes are made up).
    Conversation,
}

#[derive(Debug, Args)]
pub struct InitArgs {
    /// The kind of endpoint that answers.
    #[arg(long, value_enum, default_value = "mock")]
    pub endpoint: InitEndpoint,

    /// What the task does with an item.
    #[arg(long, value_enum, default_value = "chat")]
    pub task: InitTask,

    /// The config to write (the dataset, and the mock's replies, go beside it).
    #[arg(short, long, value_name = "FILE", default_value = "evalfleet.yaml")]
    pub output: PathBuf,

    /// Overwrite files that exist.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Debug, Args)]
pub struct ManArgs {
    /// The folder to write the pages to.
    #[arg(short, long, value_name = "DIR", default_value = ".")]
    pub out: PathBuf,
}

#[derive(Debug, Args)]
pub struct StoreArgs {
    /// The store: a SQLite file, or a postgres:// URL [default: runs/evalfleet.db, or $EVALFLEET_STORE]
    #[arg(long)]
    pub store: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The run's YAML config.
    pub config: PathBuf,

    /// The store: a SQLite file, or a postgres:// URL [default: the config's `store`, $EVALFLEET_STORE, or runs/evalfleet.db]
    #[arg(long)]
    pub store: Option<PathBuf>,

    /// The run's id [default: NAME-DATE-TIME-XXXX]
    #[arg(long)]
    pub run_id: Option<String>,

    /// Answer a deterministic sample of N items.
    #[arg(long, value_name = "N")]
    pub n_sample: Option<u64>,

    /// The sample's seed.
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,

    /// Answer only the dataset's first N rows (`dataset.limit`).
    #[arg(long, value_name = "N")]
    pub limit: Option<u64>,

    /// Set any config key, recorded with the run: a dotted path (a list's
    /// item by its index or its `name`: `endpoints.vllm.model`,
    /// `task.params.temperature`, `task.max_tokens`), and a value read as
    /// JSON when it is JSON (`0.7`, `true`, `[1, 2]`), else as text. Repeat
    /// it for several keys.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,

    /// Answer yes to every question (e.g. start an engine on a GPU someone else is using).
    #[arg(short = 'y', long = "yes")]
    pub yes: bool,

    /// Only these configured endpoints take part (the others stay idle; `fleet add` brings them in).
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub endpoints: Vec<String>,

    /// Show what each endpoint would run (engines, tunnels, commands) and exit.
    #[arg(long)]
    pub dry_run: bool,

    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Episodes to simulate [default: task.conversation.sessions].
    #[arg(long, value_name = "N")]
    pub sessions: Option<u64>,

    /// Decisions after which an episode ends [default: task.conversation.max_steps].
    #[arg(long, value_name = "M")]
    pub max_steps: Option<u32>,

    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Args)]
pub struct EnvArgs {
    /// The run's YAML config (task.kind: conversation; its policy is the trainer). With --resume: instead of the stored one.
    #[arg(required_unless_present = "resume")]
    pub config: Option<PathBuf>,

    /// Serve the rest of a stopped environment run: its episodes done stay done, the others are served.
    #[arg(long, value_name = "RUN_ID", conflicts_with_all = ["sessions", "max_steps", "run_id"])]
    pub resume: Option<String>,

    /// With --resume: serve the run's failed episodes again too (those the trainer closed among them).
    #[arg(long, requires = "resume")]
    pub retry_failed: bool,

    /// Episodes to serve [default: task.conversation.sessions].
    #[arg(long, value_name = "N")]
    pub sessions: Option<u64>,

    /// Decisions after which an episode ends (truncated) [default: task.conversation.max_steps].
    #[arg(long, value_name = "M")]
    pub max_steps: Option<u32>,

    /// Episodes per line of batch_summary.jsonl and metrics.jsonl, in the order they end (a PPO batch) [default: task.conversation.batch_size, 16].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_size: Option<u32>,

    /// Environments a trainer steps at once (episodes up to twice as many wait at a decision).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub envs: usize,

    /// Where to listen. Any address but a loopback one needs an API key
    /// (EVALFLEET_API_KEY), which every request then sends as X-API-Key or
    /// Authorization: Bearer.
    #[arg(long, default_value = "127.0.0.1:8765")]
    pub bind: SocketAddr,

    /// How long an episode a trainer holds (after its reset or step) waits for the action before the decision counts as invalid; one waiting for a reset waits as long as it takes.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10m")]
    pub action_timeout: Duration,

    /// The longest a reset waits for an episode to reach its first decision (a reset's {"wait_s": S} asks for less).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    pub reset_wait: Duration,

    /// How long a step waits for the episode's next decision.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    pub step_wait: Duration,

    /// End when every episode has ended, rather than serving on (resets answer 410) until Ctrl-C.
    #[arg(long)]
    pub exit_when_done: bool,

    /// Serve on after the last episode: the default now; kept for scripts that pass it.
    #[arg(long, hide = true, conflicts_with = "exit_when_done")]
    pub stay: bool,

    /// The store: a SQLite file, or a postgres:// URL [default: the config's `store`, $EVALFLEET_STORE, or runs/evalfleet.db]
    #[arg(long)]
    pub store: Option<PathBuf>,

    /// The run's id [default: NAME-DATE-TIME-XXXX]
    #[arg(long)]
    pub run_id: Option<String>,

    /// Only these configured endpoints take part.
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub endpoints: Vec<String>,

    /// Answer yes to every question.
    #[arg(short = 'y', long = "yes")]
    pub yes: bool,
}

#[derive(Debug, Args)]
pub struct OutputArgs {
    /// No progress display.
    #[arg(short, long)]
    pub quiet: bool,
}

#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// The run to finish.
    pub run_id: String,

    /// The store: a SQLite file, or a postgres:// URL [default: runs/evalfleet.db, or $EVALFLEET_STORE]
    #[arg(long)]
    pub store: Option<PathBuf>,

    /// Also answer again the items that failed.
    #[arg(long)]
    pub retry_failed: bool,

    /// Use this config instead of the stored one (its dataset and task must match the run's).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Only these configured endpoints take part.
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub endpoints: Vec<String>,

    /// Answer yes to every question.
    #[arg(short = 'y', long = "yes")]
    pub yes: bool,

    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// The shared store [default: $EVALFLEET_STORE]
    #[arg(long)]
    pub store: Option<PathBuf>,

    /// Join this run only (and exit when it ends); without it, join each running run in turn.
    #[arg(long, value_name = "RUN_ID")]
    pub run: Option<String>,

    /// This worker's endpoints (say, the engines of its own host), in place of the run's: a YAML file whose one key is `endpoints:`, written as in a config.
    #[arg(long, value_name = "FILE")]
    pub endpoints: Option<PathBuf>,

    /// How often a worker without a run looks for one.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub poll: std::time::Duration,

    /// Answer yes to every question.
    #[arg(short = 'y', long = "yes")]
    pub yes: bool,

    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    pub run_id: String,

    #[command(flatten)]
    pub store: StoreArgs,

    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ExportFormat {
    Jsonl,
    Csv,
    /// Typed columns (text, integers, floats, booleans), a float column
    /// `score.NAME` per metric, the input row as JSON text in `item`.
    Parquet,
    /// Each item's agent run (`kind: exec`) as a chat-format conversation
    /// (messages with tool calls and results, tools, status and scores),
    /// one JSON line an item.
    Trajectories,
}

#[derive(Debug, Args)]
pub struct SyncArgs {
    pub run_id: String,

    #[command(flatten)]
    pub store: StoreArgs,

    /// Use this config's dataset.sheet instead of the run's stored one (a
    /// new key variable, another api_url).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    pub run_id: String,

    #[command(flatten)]
    pub store: StoreArgs,

    /// The format; without it, the one `-o`'s name ends with (`.jsonl`,
    /// `.csv`, `.parquet`).
    #[arg(long, value_enum)]
    pub format: Option<ExportFormat>,

    /// Write here (atomically) instead of to standard output.
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,

    /// With `--format trajectories`: the conversations of each item's
    /// final attempt, or of every attempt (failed and unfinished ones
    /// included, each line saying how its attempt ended).
    #[arg(long, value_enum, value_name = "WHICH")]
    pub attempts: Option<TrajectoryAttempts>,
}

/// Which attempts' conversations `export --format trajectories` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TrajectoryAttempts {
    Final,
    All,
}

impl ExportArgs {
    /// `--format`, else the format `-o`'s name ends with.
    pub fn format(&self) -> Result<ExportFormat, crate::UsageError> {
        if let Some(format) = self.format {
            return Ok(format);
        }
        let extension = self
            .output
            .as_deref()
            .and_then(|file| file.extension())
            .map(|e| e.to_string_lossy().to_ascii_lowercase());
        match extension.as_deref() {
            Some("jsonl") => Ok(ExportFormat::Jsonl),
            Some("csv") => Ok(ExportFormat::Csv),
            Some("parquet") => Ok(ExportFormat::Parquet),
            _ => Err(crate::UsageError(format!(
                "export: give --format (jsonl, csv, parquet or trajectories){}",
                match &self.output {
                    Some(file) => format!(
                        ": {} does not end with .jsonl, .csv or .parquet",
                        file.display()
                    ),
                    None => ", or -o FILE ending with .jsonl, .csv or .parquet".to_owned(),
                }
            ))),
        }
    }
}

#[derive(Debug, Args)]
pub struct FleetArgs {
    #[command(subcommand)]
    pub action: FleetAction,
}

#[derive(Debug, Subcommand)]
pub enum FleetAction {
    /// Bring a configured endpoint into the run.
    Add(FleetTarget),
    /// Take an endpoint out of the run.
    Remove(FleetTarget),
}

#[derive(Debug, Args)]
pub struct FleetTarget {
    pub run_id: String,
    /// The endpoint's name in the run's config.
    pub endpoint: String,

    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    pub config: PathBuf,
}

#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The original system's YAML config (top-level `env:`, `scorer:`, `llm:`, ...).
    pub original: PathBuf,

    /// Write the evalfleet config here instead of stdout.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct MetricsArgs {
    /// A config whose task.metric_backends' metrics are listed too
    pub config: Option<PathBuf>,

    /// Print JSON (a list of metrics) instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The store [default: runs/evalfleet.db, or $EVALFLEET_STORE]; created if absent.
    #[arg(long)]
    pub store: Option<PathBuf>,

    /// Address to listen on (port 0: any free port). Any address but a
    /// loopback one needs EVALFLEET_API_KEY.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub bind: SocketAddr,

    /// A directory a config sent to the server may read and write files
    /// under (its dataset, schema, cache; a config named by `config_path`);
    /// repeat for more [default: the current directory]. A config sent as
    /// text reads relative paths from the first.
    #[arg(long = "allow-root", value_name = "DIR")]
    pub allow_roots: Vec<PathBuf>,

    /// A name the server is reached by (a DNS name, `.domain` for every name
    /// under it); repeat for more. It answers only requests addressed to
    /// its own names: the bound address, localhost, and these.
    #[arg(long = "allow-host", value_name = "NAME")]
    pub allow_hosts: Vec<String>,

    /// An environment variable a config sent to the server may read as
    /// `${NAME}`, in an endpoint's api_key, headers or env only, and the
    /// hosts it may be sent to: an endpoint using it must have its base_url
    /// on one of them (e.g. OPENAI_API_KEY=api.openai.com); repeat for more
    /// [default: none].
    #[arg(long = "allow-env", value_name = "NAME=HOST[,HOST]")]
    pub allow_env: Vec<String>,

    /// Let a config sent to the server run commands on this machine as the
    /// server's user: start engines (`local`, `remote` over ssh), run an
    /// endpoint's `start_cmd` and `stop_cmd`, choose the code judge's
    /// `python` or `compiler`. Anyone who can reach the API can then run
    /// anything here.
    #[arg(long)]
    pub allow_commands: bool,

    /// Change nothing: every request that would (start, resume, stop, score
    /// again, change a fleet) is refused.
    #[arg(long)]
    pub read_only: bool,
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub action: Option<BenchAction>,

    /// The bench file to run (a file named `status` or `report`: write `./status`).
    #[arg(required = true)]
    pub config: Option<PathBuf>,

    /// The store: a SQLite file, or a postgres:// URL [default: the bench file's `store`, runs/evalfleet.db, or $EVALFLEET_STORE]
    #[arg(long)]
    pub store: Option<PathBuf>,

    /// Start engines on GPUs someone else is using, without asking.
    #[arg(short = 'y', long = "yes")]
    pub yes: bool,
}

#[derive(Debug, Subcommand)]
pub enum BenchAction {
    /// Each cell's state: pending, running, done, failed or interrupted, items ended, run id.
    Status(BenchStatusArgs),
    /// Compare every model on every dataset: headline metric with its interval, by category, latency, TTFT, TPOT, tokens/s, engine start.
    Report(BenchReportArgs),
}

#[derive(Debug, Args)]
pub struct BenchStatusArgs {
    /// The bench file, or the bench's name (its plan is kept beside the store).
    pub bench: String,

    #[command(flatten)]
    pub store: StoreArgs,

    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum BenchFormat {
    Table,
    Csv,
    Json,
}

#[derive(Debug, Args)]
pub struct BenchReportArgs {
    /// The bench file, or the bench's name (its plan is kept beside the store).
    pub bench: String,

    #[command(flatten)]
    pub store: StoreArgs,

    #[arg(long, value_enum, default_value = "table")]
    pub format: BenchFormat,

    /// Also write the report as one self-contained HTML page.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct MockArgs {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub bind: SocketAddr,

    /// Append `listening MS PID` to FILE once it listens and `exited MS PID`
    /// when it stops (ms since the epoch): an engine's own account of its
    /// life, for tests and benchmarks of engine turns.
    #[arg(long, value_name = "FILE")]
    pub life_log: Option<PathBuf>,

    #[command(flatten)]
    pub settings: MockSettings,
}

#[derive(Debug, Args)]
pub struct ScoreArgs {
    pub run_id: String,

    #[command(flatten)]
    pub store: StoreArgs,

    /// Take task.parse, task.schema, task.max_reasks, task.metrics and task.code from this config
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Recompute only these metrics (names or keys); the others keep their scores
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub metrics: Vec<String>,

    /// Run the code judge again over the stored answers (with task.code from
    /// --config when given; a changed task.code implies it). Without it a
    /// code task keeps its stored judgements.
    #[arg(long)]
    pub rejudge: bool,

    /// Judge again the answers the judges could not judge, and only those
    /// (the other judgements stand): the code judge runs their programs
    /// again (its server was unreachable or restarting, its sandbox
    /// failing), and LLM judges are asked again where their call failed
    /// (a judge endpoint of kind external, or the built-in mock; its
    /// secrets come from the environment as the run's did). What finishes a
    /// run left incomplete by its judge.
    #[arg(long, conflicts_with = "rejudge")]
    pub unjudged: bool,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    pub run_id: String,

    #[command(flatten)]
    pub store: StoreArgs,

    /// Item fields to group by (each combination of their values is a
    /// category; `@prompt`: the rule of task.prompts) [default: the run's
    /// report.by, else doc_type when the items have it]
    #[arg(long, value_delimiter = ',', value_name = "FIELD,...")]
    pub by: Vec<String>,

    /// Where the CSV and JSON files go [default: reports/RUN_ID beside the store]
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,

    /// Print the JSON summary instead of tables
    #[arg(long)]
    pub json: bool,

    /// Also write the report as one self-contained HTML page (it needs no
    /// server and fetches nothing), for sharing
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,

    /// Exit 1 when a metric could not score this share of the answers it
    /// was given or more [default: the run's report.max_unscored, else 1]
    #[arg(long, value_name = "SHARE", value_parser = share)]
    pub max_unscored: Option<f64>,
}

/// A share from 0 to 1.
fn share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("must be a number from 0 to 1, got '{text}'")),
    }
}

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Two or more runs; each is compared with the first
    #[arg(required = true, num_args = 2..)]
    pub runs: Vec<String>,

    #[command(flatten)]
    pub store: StoreArgs,

    /// Item fields to group by
    #[arg(long, value_delimiter = ',', value_name = "FIELD,...")]
    pub by: Vec<String>,

    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct CacheArgs {
    #[command(subcommand)]
    pub action: CacheAction,

    /// The store: a SQLite file, or a postgres:// URL [default: runs/evalfleet.db, or $EVALFLEET_STORE]
    #[arg(long, global = true)]
    pub store: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum CacheAction {
    /// Entries, their size and age, and how many attempts the cache answered
    Stats {
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Delete every entry
    Clear,
}

/// `evalfleet supervise` (internal): runs an engine's command in a process
/// group of its own, in a session apart from the run's, and ends it with
/// the run.
#[derive(Debug, clap::Args)]
pub struct SuperviseArgs {
    /// Where to write the command's pid once it runs.
    #[arg(long)]
    pub pid_file: PathBuf,

    /// Between SIGTERM and SIGKILL.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub grace: Duration,

    /// A shell command to run once the group has ended.
    #[arg(long)]
    pub on_exit: Option<String>,

    /// A claim file, held locked while this supervisor lives; what it
    /// starts carries the file's path (EVALFLEET_CLAIM), and what a dead
    /// holder of the same file left is ended before the command starts.
    #[arg(long)]
    pub claim: Option<PathBuf>,

    /// How long to wait for a live holder of --claim to let it go.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub claim_wait: Duration,

    /// Claim files whose path starts with this: what their dead holders
    /// left is ended before the command starts.
    #[arg(long)]
    pub leftovers: Option<PathBuf>,

    /// What the log says was started, instead of the command itself.
    #[arg(long)]
    pub label: Option<String>,

    /// The command, run by `sh -c`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}
