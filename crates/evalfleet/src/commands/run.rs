//! `evalfleet run` and `evalfleet resume`.

use evalfleet_config::Overrides;
use evalfleet_core::session::{self, Resumable, Resume};

use super::store_location;
use crate::attend::{self, Attendance, Lift};
use crate::cli::{ResumeArgs, RunArgs};
use crate::ui;
use crate::{EXIT_FAILED, EXIT_OK};

pub async fn run(args: RunArgs) -> anyhow::Result<u8> {
    attend::start(args, Overrides::default(), false).await
}

pub async fn resume(args: ResumeArgs) -> anyhow::Result<u8> {
    let location = store_location(args.store, None)?;
    let frontend = attend::frontend()?;
    let resumed = session::resumable(
        location,
        &args.run_id,
        args.config.as_deref(),
        Resume {
            retry_failed: args.retry_failed,
            endpoints: &args.endpoints,
            yes: args.yes,
            roots: None,
        },
        &frontend,
    )
    .await
    .lift()?;
    match resumed {
        Resumable::Nothing { counts } => {
            ui::note(&format!(
                "Run {} has no pending items ({} done, {} failed); nothing to resume{}.",
                args.run_id,
                counts.done,
                counts.failed,
                if counts.failed > 0 {
                    " (--retry-failed answers the failed ones again)"
                } else {
                    ""
                }
            ));
            Ok(if counts.failed > 0 {
                EXIT_FAILED
            } else {
                EXIT_OK
            })
        }
        Resumable::Session(session) => {
            attend::execute(
                *session,
                Attendance::Terminal {
                    quiet: args.output.quiet,
                },
                None,
                &frontend,
            )
            .await
        }
    }
}
