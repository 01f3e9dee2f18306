//! `evalfleet simulate`: a run of a conversation config (`kind:
//! conversation`), then its episodes' totals and the logs trainers' tools
//! read, in the run's directory beside the store.

use evalfleet_config::Overrides;

use crate::cli::SimulateArgs;

pub async fn simulate(args: SimulateArgs) -> anyhow::Result<u8> {
    let overrides = Overrides {
        sessions: args.sessions,
        max_steps: args.max_steps,
        ..Overrides::default()
    };
    crate::attend::start(args.run, overrides, true).await
}
