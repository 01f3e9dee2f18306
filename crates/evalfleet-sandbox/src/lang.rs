//! The languages the judge runs: how a program is found in an answer,
//! written, compiled once, and run for each test.

use std::path::{Path, PathBuf};

/// A program's language (`task.code.language`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    Python,
    Cpp,
    Rust,
}

impl Language {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "python" => Some(Self::Python),
            "cpp" | "c++" => Some(Self::Cpp),
            "rust" => Some(Self::Rust),
            _ => None,
        }
    }

    /// Its name, as SandboxFusion calls it too.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Python => "python",
            Self::Cpp => "cpp",
            Self::Rust => "rust",
        }
    }

    /// The tags a fenced block of this language carries.
    pub fn fence_tags(self) -> &'static [&'static str] {
        match self {
            Self::Python => &["python", "py", "python3"],
            Self::Cpp => &["cpp", "c++", "cc", "cxx"],
            Self::Rust => &["rust", "rs"],
        }
    }

    pub fn source_file(self) -> &'static str {
        match self {
            Self::Python => "main.py",
            Self::Cpp => "main.cpp",
            Self::Rust => "main.rs",
        }
    }

    pub fn compiled(self) -> bool {
        !matches!(self, Self::Python)
    }

    /// A program that prints `ok`, to check a toolchain at start.
    pub fn hello(self) -> &'static str {
        match self {
            Self::Python => "print('ok')\n",
            Self::Cpp => "#include <cstdio>\nint main() { std::puts(\"ok\"); }\n",
            Self::Rust => "fn main() { println!(\"ok\"); }\n",
        }
    }

    /// The interpreter or compiler used when the task names none.
    pub fn default_tool(self) -> &'static str {
        match self {
            Self::Python => "python3",
            Self::Cpp => "g++",
            Self::Rust => "rustc",
        }
    }
}

/// How the sandbox runs a language's programs.
#[derive(Debug, Clone)]
pub struct Toolchain {
    pub language: Language,
    /// The interpreter or compiler, as programs in the sandbox see it (a
    /// name looked up on the sandbox's PATH, or a path).
    pub tool: String,
    /// A directory of this machine the tool needs bound into the sandbox.
    pub host_dir: Option<PathBuf>,
    /// C++: the libraries of [`CPP_OPTIONAL_LIBRARIES`] this compiler can
    /// link, linked into every program as SandboxFusion links them.
    pub libraries: Vec<&'static str>,
}

/// What C++ programs are compiled with, as SandboxFusion (at 469de08,
/// `run_cpp`) compiles them: the standard, and no optimisation, so that a
/// program is as fast (and its verdict the same) on either backend.
pub const CPP_FLAGS: &[&str] = &["-std=c++17"];

/// Libraries SandboxFusion links into C++ programs when its compiler can
/// link them (it tries each once, at its start).
pub const CPP_OPTIONAL_LIBRARIES: &[&str] = &["-lcrypto", "-lssl", "-lpthread"];

impl Toolchain {
    /// Finds the tool for `language`. `rustc` is found through its sysroot:
    /// the `rustc` on PATH is often rustup's proxy, which reads its
    /// owner's home, where the sandbox's users may not go; the sysroot is
    /// bound into the sandbox instead.
    pub async fn resolve(language: Language, tool: Option<&str>) -> Result<Self, String> {
        let named = tool.unwrap_or(language.default_tool()).to_owned();
        if language == Language::Cpp {
            let libraries = linkable(&named).await;
            return Ok(Self {
                language,
                tool: named,
                host_dir: None,
                libraries,
            });
        }
        if language != Language::Rust {
            return Ok(Self {
                language,
                tool: named,
                host_dir: None,
                libraries: Vec::new(),
            });
        }
        let output = tokio::process::Command::new(&named)
            .args(["--print", "sysroot"])
            .output()
            .await
            .map_err(|e| format!("cannot run '{named} --print sysroot': {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "'{named} --print sysroot' failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        let sysroot = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
        if !sysroot.join("bin/rustc").is_file() {
            return Err(format!(
                "no rustc in the sysroot '{}' that '{named}' names",
                sysroot.display()
            ));
        }
        Ok(Self {
            language,
            tool: sysroot.join("bin/rustc").to_string_lossy().into_owned(),
            host_dir: Some(sysroot),
            libraries: Vec::new(),
        })
    }

    /// Where the tool is once its directory is seen at `inside`.
    pub fn bound_at(&mut self, inside: &Path) {
        if self.language == Language::Rust {
            self.tool = inside.join("bin/rustc").to_string_lossy().into_owned();
        }
    }

    /// The command that compiles `source_file` into `main` in the working
    /// directory; `None` for an interpreted language.
    pub fn compile_argv(&self) -> Option<Vec<String>> {
        let mut argv = vec![self.tool.clone()];
        match self.language {
            Language::Python => return None,
            Language::Cpp => {
                argv.extend(CPP_FLAGS.iter().map(|a| (*a).to_owned()));
                argv.extend(["main.cpp", "-o", "main"].map(str::to_owned));
                argv.extend(self.libraries.iter().map(|a| (*a).to_owned()));
            }
            Language::Rust => {
                argv.extend(["--edition=2021", "-O", "-o", "main", "main.rs"].map(str::to_owned));
            }
        }
        Some(argv)
    }

    /// The command that runs a program: the script in the working
    /// directory, or the compiled `main` in `build` (as seen inside).
    pub fn run_argv(&self, build: Option<&Path>) -> Vec<String> {
        match build {
            Some(dir) => vec![dir.join("main").to_string_lossy().into_owned()],
            None => vec![self.tool.clone(), self.language.source_file().to_owned()],
        }
    }
}

/// Which of [`CPP_OPTIONAL_LIBRARIES`] `compiler` links: each tried once on
/// an empty program, at once, as SandboxFusion does at its start.
async fn linkable(compiler: &str) -> Vec<&'static str> {
    let tries = CPP_OPTIONAL_LIBRARIES.iter().map(|library| async move {
        let mut child = tokio::process::Command::new(compiler)
            .args(["-x", "c++", "-", "-o", "/dev/null", library])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .ok()?;
        if let Some(mut input) = child.stdin.take() {
            use tokio::io::AsyncWriteExt;
            input.write_all(b"int main() { return 0; }\n").await.ok()?;
        }
        let linked = child.wait().await.ok()?.success();
        linked.then_some(*library)
    });
    futures_util::future::join_all(tries)
        .await
        .into_iter()
        .flatten()
        .collect()
}
