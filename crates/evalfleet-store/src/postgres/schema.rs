//! The PostgreSQL schema, as the migrations that built it. Every table is
//! in the schema `evalfleet` of the database named by the URL, so a store
//! may share a database with other programs' tables. Migrations are applied
//! in order, each once, under an advisory lock (workers starting together
//! take turns), and `evalfleet.schema_version` remembers how many were.
//!
//! Work is handed out item by item, so the queue's state is a narrow table
//! of its own (`items`: state, attempt, claim, owner, lease, not-before),
//! updated in place many times per item; what never changes once an item
//! is registered (its id, line, offset, sample key) is in `item_rows`.
//! Times a lease or a wait is measured by are `timestamptz` values of the
//! database's clock (`now()`), never a worker's; times that are facts about
//! a call (when it was sent, when it ended) are milliseconds since the
//! epoch, as the worker that made it measured them.

/// 1: the whole schema of evalfleet 0.1 (SQLite's twelve migrations, as
/// one), with the queue made for many workers.
const FIRST: &str = r#"
CREATE TABLE runs (
    rid         bigserial PRIMARY KEY,
    run_id      text NOT NULL UNIQUE,
    name        text NOT NULL,
    status      text NOT NULL,
    created_at  bigint NOT NULL,
    updated_at  bigint NOT NULL,
    config      text NOT NULL,
    config_dir  text NOT NULL,
    fingerprint text NOT NULL,
    digest      text NOT NULL,
    dataset     text NOT NULL,
    total       bigint NOT NULL,
    sessions    integer NOT NULL DEFAULT 0,
    message     text,
    -- Raised by each session and rescore; a commit raises its worker's
    -- row of `tallies` instead, and a run's generation is the sum of both.
    generation  bigint NOT NULL DEFAULT 0
);
-- Items done and failed, and commits made, per worker of a run: each commit
-- adds to its own worker's row, so that workers committing at once do not
-- queue on one row; a run's counts are the sums of its rows, and it was
-- last updated at the latest of theirs and its own.
CREATE TABLE tallies (
    rid        bigint NOT NULL REFERENCES runs(rid),
    worker     text NOT NULL,
    done       bigint NOT NULL DEFAULT 0,
    failed     bigint NOT NULL DEFAULT 0,
    generation bigint NOT NULL DEFAULT 0,
    -- Its last commit (ms since the epoch, the worker's clock).
    updated_at bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (rid, worker)
);
-- What never changes once an item is registered.
CREATE TABLE item_rows (
    rid        bigint NOT NULL REFERENCES runs(rid),
    seq        bigint NOT NULL,
    item_id    text NOT NULL,
    line       bigint NOT NULL,
    "offset"   bigint NOT NULL,
    sample_key bigint NOT NULL,
    invalid    text,
    PRIMARY KEY (rid, seq),
    UNIQUE (rid, item_id)
);
-- The queue: one narrow row per item, updated in place as it is claimed,
-- renewed and ended. `attempt` counts its claims: each claim raises it and
-- is fenced by it (with the claim's id, which is unique in the store). An
-- item `running` whose `lease_until` has passed is free to claim again;
-- one `pending` waits until `not_before` (a Retry-After, a backoff).
-- Free space is left in each page so that these updates stay on their page
-- (no index entry moves unless the state does), and autovacuum comes early
-- and without pauses, as a queue's dead rows pile up fast.
CREATE TABLE items (
    rid         bigint NOT NULL REFERENCES runs(rid),
    seq         bigint NOT NULL,
    state       text NOT NULL CHECK (state = 'pending' OR state = 'running' OR state = 'done' OR state = 'failed'),
    attempt     integer NOT NULL DEFAULT 0,
    claim_id    bigint,
    owner       text,
    lease_until timestamptz,
    not_before  timestamptz,
    -- The worker whose lapsed lease was reaped, until its heartbeat hears
    -- of it.
    lost_by     text,
    PRIMARY KEY (rid, seq)
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.01,
        autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0);
CREATE INDEX items_pending ON items (rid, seq) WHERE state = 'pending';
-- By seq: a commit ends its items by their key, and the planner, finding
-- this index small, uses it for that too; a worker's own (renewal,
-- release) are read off it by owner.
CREATE INDEX items_running ON items (rid, seq) WHERE state = 'running';
CREATE INDEX items_lost ON items (rid, lost_by) WHERE lost_by IS NOT NULL;
CREATE SEQUENCE claim_ids;
CREATE TABLE results (
    rid               bigint NOT NULL REFERENCES runs(rid),
    seq               bigint NOT NULL,
    item_id           text NOT NULL,
    status            text NOT NULL CHECK (status = 'done' OR status = 'failed'),
    output            text,
    error             text,
    endpoint          text,
    model             text,
    attempts          integer NOT NULL,
    latency_ms        double precision,
    ttft_ms           double precision,
    tpot_ms           double precision,
    prompt_tokens     bigint,
    completion_tokens bigint,
    finish_reason     text,
    item              text,
    finished_at       bigint NOT NULL,
    parsed            text,
    verdict           text,
    check_error       text,
    scores            text,
    reasks            integer NOT NULL DEFAULT 0,
    judge             text,
    cached            integer NOT NULL DEFAULT 0,
    tokens_estimated  boolean NOT NULL DEFAULT false,
    prompt            text,
    images            text,
    -- The claim (the item's attempt, in `items`) it was committed under,
    -- and by which worker.
    claim_attempt     integer NOT NULL,
    worker            text NOT NULL,
    PRIMARY KEY (rid, seq)
);
-- Pages of results in item-id order (`ResultOrder::Key`, which compares
-- two runs side by side), read by byte order of the ids whatever the
-- database's collation: an index scan, not a sort of the whole run.
CREATE INDEX results_by_id ON results (rid, item_id COLLATE "C");
CREATE TABLE attempts (
    rid               bigint NOT NULL REFERENCES runs(rid),
    seq               bigint NOT NULL,
    attempt           integer NOT NULL,
    session           integer NOT NULL,
    endpoint          text NOT NULL,
    model             text NOT NULL,
    sent_at           bigint NOT NULL,
    latency_ms        double precision NOT NULL,
    ttft_ms           double precision,
    tpot_ms           double precision,
    prompt_tokens     bigint,
    completion_tokens bigint,
    finish_reason     text,
    http_status       integer,
    error_class       text,
    error             text,
    cached            boolean NOT NULL DEFAULT false,
    tokens_estimated  boolean NOT NULL DEFAULT false,
    worker            text NOT NULL,
    PRIMARY KEY (rid, seq, attempt)
);
CREATE TABLE agent_calls (
    rid               bigint NOT NULL REFERENCES runs(rid),
    seq               bigint NOT NULL,
    attempt           integer NOT NULL,
    idx               integer NOT NULL,
    call_id           text NOT NULL,
    api               text NOT NULL,
    asked_model       text NOT NULL,
    sent_at           bigint NOT NULL,
    endpoint          text NOT NULL,
    model             text NOT NULL,
    latency_ms        double precision NOT NULL,
    ttft_ms           double precision,
    tpot_ms           double precision,
    prompt_tokens     bigint,
    completion_tokens bigint,
    tokens_estimated  boolean NOT NULL DEFAULT false,
    finish_reason     text,
    stream            boolean NOT NULL,
    cached            boolean NOT NULL,
    http_status       integer NOT NULL,
    error_class       text,
    error             text,
    request           text NOT NULL,
    request_cut       boolean NOT NULL,
    response          text,
    tags              text,
    PRIMARY KEY (rid, seq, attempt, idx)
);
CREATE TABLE workers (
    rid           bigint NOT NULL REFERENCES runs(rid),
    worker        text NOT NULL,
    session       integer NOT NULL,
    host          text NOT NULL,
    pid           bigint NOT NULL,
    process_start bigint NOT NULL,
    started_at    bigint NOT NULL,
    -- The database's clock.
    heartbeat_at  timestamptz NOT NULL,
    lease_ms      bigint NOT NULL,
    PRIMARY KEY (rid, worker)
);
CREATE TABLE events (
    id       bigserial PRIMARY KEY,
    rid      bigint NOT NULL REFERENCES runs(rid),
    at       bigint NOT NULL,
    kind     text NOT NULL,
    endpoint text,
    message  text NOT NULL
);
CREATE INDEX events_by_run ON events (rid, at);
CREATE TABLE endpoint_states (
    rid        bigint NOT NULL REFERENCES runs(rid),
    endpoint   text NOT NULL,
    snapshot   text NOT NULL,
    updated_at bigint NOT NULL,
    PRIMARY KEY (rid, endpoint)
);
CREATE TABLE fleet_changes (
    id       bigserial PRIMARY KEY,
    rid      bigint NOT NULL REFERENCES runs(rid),
    at       bigint NOT NULL,
    action   text NOT NULL CHECK (action = 'add' OR action = 'remove'),
    endpoint text NOT NULL,
    taken    boolean NOT NULL DEFAULT false
);
-- Answers by the SHA-256 of their request, shared by every run of the
-- store; `id` is insertion order, so eviction takes the oldest first.
CREATE TABLE cache (
    id                bigserial PRIMARY KEY,
    key               bytea NOT NULL UNIQUE,
    content           text NOT NULL,
    endpoint          text NOT NULL,
    model             text NOT NULL,
    prompt_tokens     bigint,
    completion_tokens bigint,
    finish_reason     text,
    latency_ms        double precision NOT NULL,
    created_at        bigint NOT NULL
);
CREATE INDEX cache_by_age ON cache (created_at);
CREATE TABLE samples (
    rid    bigint NOT NULL REFERENCES runs(rid),
    at     bigint NOT NULL,
    worker text NOT NULL,
    sample text NOT NULL,
    PRIMARY KEY (rid, at, worker)
);
CREATE TABLE kept_reports (
    rid         bigint NOT NULL REFERENCES runs(rid),
    key         text NOT NULL,
    fingerprint text NOT NULL,
    body        text NOT NULL,
    made_at     bigint NOT NULL,
    PRIMARY KEY (rid, key)
);
CREATE TABLE resource_points (
    rid     bigint NOT NULL REFERENCES runs(rid),
    source  text NOT NULL,
    name    text NOT NULL,
    metric  text NOT NULL,
    at      bigint NOT NULL,
    until   bigint NOT NULL,
    mean    double precision NOT NULL,
    peak    double precision NOT NULL,
    samples bigint NOT NULL,
    PRIMARY KEY (rid, source, name, metric, at)
);
-- Writes that adding twice would change (events, fleet changes, resource
-- samples), by a token their caller drew: a write run again because its
-- connection was lost after COMMIT reached the server finds its token and
-- is not stored twice. Kept a day.
CREATE TABLE applied (
    token bigint PRIMARY KEY,
    value bigint NOT NULL,
    at    timestamptz NOT NULL DEFAULT now()
);
"#;

/// 2: provider quotas shared by the workers that use one API key (see
/// `quotas`), over every run of the store.
const QUOTAS: &str = r#"
-- A quota of an API key (its SHA-256: the key is never stored) for a model,
-- in `requests` or `tokens`, as a GCRA cell: `tat` is when the next unit
-- comes free on the database's clock (now or past: the quota is full). Each
-- unit taken moves it one unit's time forward, at most a burst ahead of
-- now. `cool_until` stops every take until then (a 429's Retry-After).
-- `granted` is what the last take granted, so that the statement that
-- moved `tat` can say how far. Rows are updated in place many times a
-- second: the free space keeps the updates on their page.
CREATE TABLE quotas (
    key_hash   text NOT NULL,
    model      text NOT NULL,
    kind       text NOT NULL CHECK (kind = 'requests' OR kind = 'tokens'),
    tat        timestamptz NOT NULL,
    cool_until timestamptz NOT NULL DEFAULT '-infinity',
    granted    bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (key_hash, model, kind)
) WITH (fillfactor = 50, autovacuum_vacuum_cost_delay = 0);
"#;

/// 3: an agent call's tries that failed on other endpoints before the
/// gateway made it on the one that answered (JSON; NULL for none).
const FAILOVERS: &str = "ALTER TABLE agent_calls ADD COLUMN IF NOT EXISTS failovers text;";

/// 4: an agent call's request and response kept whole: a long one
/// compressed (zstd) in these columns, its text column then empty
/// (`request`) or NULL (`response`).
const WHOLE_BODIES: &str = "ALTER TABLE agent_calls ADD COLUMN IF NOT EXISTS request_z bytea, \
                            ADD COLUMN IF NOT EXISTS response_z bytea;";

/// 5: where a worker's pid means it (see `WorkerInfo::pid_scope`).
const PID_SCOPE: &str =
    "ALTER TABLE workers ADD COLUMN IF NOT EXISTS pid_scope text NOT NULL DEFAULT '';";

/// 6: each worker keeps its own snapshot of an endpoint (they are summed
/// when read): one worker's no longer replaces another's.
const ENDPOINT_STATES_PER_WORKER: &str = "
ALTER TABLE endpoint_states ADD COLUMN IF NOT EXISTS worker text NOT NULL DEFAULT '';
ALTER TABLE endpoint_states DROP CONSTRAINT IF EXISTS endpoint_states_pkey;
ALTER TABLE endpoint_states ADD PRIMARY KEY (rid, endpoint, worker);
";

/// 7: the tables a commit writes a row of per call or per item check no
/// foreign key: each check locked the run's row (`FOR KEY SHARE`) for
/// every row inserted, and commits of several connections at once shared
/// that lock, at a cost of the server's CPU per item that W1 on PostgreSQL
/// measured. Their run id is the one the store read from `runs` for the
/// commit, and runs are never deleted.
const HOT_TABLES_UNCHECKED: &str = "
ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_rid_fkey;
ALTER TABLE results DROP CONSTRAINT IF EXISTS results_rid_fkey;
ALTER TABLE agent_calls DROP CONSTRAINT IF EXISTS agent_calls_rid_fkey;
";

/// The migrations, in order; the store's version is how many were applied.
pub const MIGRATIONS: &[&str] = &[
    FIRST,
    QUOTAS,
    FAILOVERS,
    WHOLE_BODIES,
    PID_SCOPE,
    ENDPOINT_STATES_PER_WORKER,
    HOT_TABLES_UNCHECKED,
];

/// The schema version a store has once every migration ran.
pub const VERSION: i32 = MIGRATIONS.len() as i32;
