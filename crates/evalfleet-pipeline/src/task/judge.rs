//! The code judge's part in a task: starting the judge, judging a usable
//! answer as the item's program and scoring it `code_accepted`, and
//! judging stored answers again. Apart from the tasks that use it (a chat
//! whose answers are programs, the code task), so that neither names the
//! other.

use std::sync::Arc;

use evalfleet_types::{Assessment, Score, Scores};
use futures_util::StreamExt;
use serde_json::Value;

use evalfleet_sandbox::{CodeJudge, CodeJudgeError};

use super::Step;
use evalfleet_eval::{Assessor, Checked};

/// Starts the code judge of `settings` with its sandbox under `dir` (an
/// HTTP client only for a remote sandbox), and says what it enforces.
pub async fn start(
    settings: &evalfleet_sandbox::CodeSettings,
    dir: &std::path::Path,
) -> Result<CodeJudge, CodeJudgeError> {
    let http = match settings.backend {
        evalfleet_sandbox::Backend::SandboxFusion { .. } => Some(
            evalfleet_fleet::client::http_client(settings.concurrency)
                .map_err(|e| CodeJudgeError::Setup(format!("cannot make an HTTP client: {e}")))?,
        ),
        evalfleet_sandbox::Backend::Local => None,
    };
    let judge = CodeJudge::new(settings.clone(), dir, http).await?;
    if judge.degraded() {
        tracing::warn!("Code judge: {}.", judge.describe());
    } else {
        tracing::info!("Code judge: {}.", judge.describe());
    }
    Ok(judge)
}

/// Judges stored answers again (`evalfleet score --rejudge`): each `(seq,
/// item, answer)` becomes `(seq, judgement, code_accepted score)`.
pub async fn judge_again(
    judge: &CodeJudge,
    answers: Vec<(u64, Value, String)>,
) -> Vec<(u64, Option<Value>, Score)> {
    futures_util::stream::iter(answers)
        .map(|(seq, item, answer)| async move {
            let (json, score) = code_outcome(judge.judge(&item, &answer).await);
            (seq, json, score)
        })
        .buffer_unordered(backlog(judge.settings()))
        .collect()
        .await
}

/// The assessment of a usable answer judged as the program for `row`: its
/// scores with `code_accepted`, and the judgement.
async fn assessed(
    judge: &CodeJudge,
    assessor: &Assessor,
    checked: &Checked,
    row: &Value,
    answer: &str,
    mut scores: Scores,
    reasks: u32,
) -> Assessment {
    let (json, score) = code_outcome(judge.judge(row, answer).await);
    if let Some(m) = assessor
        .metrics()
        .find(|m| matches!(m.kind, evalfleet_eval::metrics::Kind::CodeAccepted))
    {
        scores.insert(m.key.clone(), score);
    }
    let mut assessment = checked.assessment(scores, reasks);
    assessment.code = json;
    assessment
}

/// The work of judging a usable answer as a program, then finishing its
/// item.
pub(super) fn judge_then_finish(
    judge: Arc<CodeJudge>,
    assessor: Arc<Assessor>,
    checked: Checked,
    row: Value,
    answer: String,
    scores: Scores,
    reasks: u32,
) -> Step {
    Step::Work(Box::pin(async move {
        let assessment = assessed(&judge, &assessor, &checked, &row, &answer, scores, reasks).await;
        Step::Finish(super::Finish::done(answer, assessment))
    }))
}

/// How many answers are judged at once: enough to keep the judge's slots
/// busy.
pub(super) fn backlog(settings: &evalfleet_sandbox::CodeSettings) -> usize {
    settings.concurrency.saturating_mul(2).max(1)
}

/// What is stored of a judgement: the judgement as JSON, and the
/// `code_accepted` score (its value, verdict and tests passed, or the
/// judge's error).
fn code_outcome(
    judged: Result<evalfleet_sandbox::Judgement, CodeJudgeError>,
) -> (Option<Value>, Score) {
    match judged {
        Ok(j) => (
            serde_json::to_value(&j).ok(),
            Score::from_json(serde_json::json!({
                "value": f64::from(u8::from(j.accepted)),
                "verdict": j.verdict.as_str(),
                "passed": j.passed,
                "total": j.total,
            })),
        ),
        Err(error) => (
            None,
            Score::error(format!("the code judge failed: {error}")),
        ),
    }
}
