//! `kind: code`: a chat task whose usable answer is a program, judged
//! against the item's tests (HumanEval, MBPP, stdin/stdout) by the code
//! judge, in a sandbox here or on a SandboxFusion server. The judgement is
//! stored with the result and scored as `code_accepted`.

use std::sync::Arc;

use evalfleet_sandbox::CodeJudge;

use super::chat::Chat;
use super::judge::backlog;
pub use super::judge::{judge_again, start};
use super::{Episode, ItemContext, Step, Task};

/// The code task: a chat with a code judge.
pub struct Code {
    chat: Chat,
    judge: Arc<CodeJudge>,
}

impl Code {
    pub fn new(chat: Chat, judge: Arc<CodeJudge>) -> Self {
        Self {
            chat: chat.judging_code(judge.clone()),
            judge,
        }
    }
}

impl Task for Code {
    fn begin(&self, item: &ItemContext<'_>) -> (Box<dyn Episode>, Step) {
        self.chat.begin(item)
    }

    /// Enough answers judged at once to keep the judge's slots busy; more
    /// would only hold rows in memory.
    fn work_limit(&self) -> usize {
        backlog(self.judge.settings())
            .max(self.chat.backend_queue() + self.chat.image_readers().unwrap_or(0))
    }
}
