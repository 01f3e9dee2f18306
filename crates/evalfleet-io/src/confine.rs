//! Where a run's dataset files may be opened from. A config of the user's
//! own opens whatever it names. One from outside (posted to `evalfleet
//! serve`, whose `--allow-root`s bound what it may read) opens only files
//! beneath those roots, resolved and opened in one step (`openat2`'s
//! `RESOLVE_BENEATH` where the kernel has it, a walk that follows no link
//! out otherwise, as `cap-std` does): a link in the tree that leads out,
//! or one swapped in after the config was admitted, fails the open instead
//! of serving the file it points to. Folder walks (a Parquet folder's
//! shards) follow no link at all.

use std::fs::File;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use cap_std::fs::Dir;

/// Where files may be opened from (see the module).
#[derive(Debug, Clone, Default)]
pub struct Confine {
    /// The roots (canonical) files must be beneath; `None`: anywhere.
    roots: Option<Arc<[PathBuf]>>,
}

impl Confine {
    /// Files of `roots` alone when given; anywhere when not.
    pub fn of(roots: Option<&[PathBuf]>) -> Self {
        Self {
            roots: roots.map(Arc::from),
        }
    }

    /// Whether opens are bounded by roots.
    pub fn is_confined(&self) -> bool {
        self.roots.is_some()
    }

    /// `path` opened to read.
    pub fn open(&self, path: &Path) -> io::Result<File> {
        if self.roots.is_none() {
            return File::open(path);
        }
        let (root, rel) = self.beneath(path)?;
        if rel.as_os_str().is_empty() {
            return Err(outside(path));
        }
        root.open(&rel)
            .map(|file| file.into_std())
            .map_err(|err| escaped(path, err))
    }

    /// Whether `path` is a folder (followed beneath the roots only).
    pub fn is_dir(&self, path: &Path) -> bool {
        if self.roots.is_none() {
            return path.is_dir();
        }
        match self.beneath(path) {
            Ok((_, rel)) if rel.as_os_str().is_empty() => true,
            Ok((root, rel)) => root.metadata(&rel).is_ok_and(|m| m.is_dir()),
            Err(_) => false,
        }
    }

    /// The files under the folder `dir` (in sub-folders too) that `keep`
    /// takes, sorted by path. Confined, it follows no link: a link in the
    /// folder, to a file or a folder, is left out.
    pub fn files_under(
        &self,
        dir: &Path,
        keep: &dyn Fn(&Path) -> bool,
    ) -> io::Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        if self.roots.is_none() {
            let mut pending = vec![dir.to_owned()];
            while let Some(folder) = pending.pop() {
                for entry in std::fs::read_dir(&folder)? {
                    let path = entry?.path();
                    if path.is_dir() {
                        pending.push(path);
                    } else if keep(&path) {
                        out.push(path);
                    }
                }
            }
        } else {
            let (root, rel) = self.beneath(dir)?;
            let top = if rel.as_os_str().is_empty() {
                root
            } else {
                root.open_dir(&rel).map_err(|err| escaped(dir, err))?
            };
            let mut pending = vec![(top, dir.to_owned())];
            while let Some((folder, at)) = pending.pop() {
                for entry in folder.entries()? {
                    let entry = entry?;
                    let kind = entry.file_type()?;
                    let path = at.join(entry.file_name());
                    if kind.is_symlink() {
                        continue;
                    }
                    if kind.is_dir() {
                        pending.push((entry.open_dir()?, path));
                    } else if kind.is_file() && keep(&path) {
                        out.push(path);
                    }
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// The root `path` is beneath, opened, and the rest of `path` under
    /// it: by its words first (a path may name a root through a link
    /// of its own, which is the admission's business), else as resolved.
    fn beneath(&self, path: &Path) -> io::Result<(Dir, PathBuf)> {
        let roots = self.roots.as_deref().unwrap_or_default();
        let absolute = if path.is_absolute() {
            path.to_owned()
        } else {
            std::env::current_dir()?.join(path)
        };
        // `..` is refused as it stands: followed through a folder outside
        // the roots, the answer would tell whether that folder exists.
        if absolute
            .components()
            .any(|c| matches!(c, Component::ParentDir))
        {
            return Err(outside(path));
        }
        let lexical: PathBuf = absolute
            .components()
            .filter(|c| !matches!(c, Component::CurDir))
            .collect();
        let found = roots
            .iter()
            .find_map(|root| {
                lexical
                    .strip_prefix(root)
                    .ok()
                    .map(|rel| (root.clone(), rel.to_owned()))
            })
            .or_else(|| {
                let resolved = absolute.canonicalize().ok()?;
                roots.iter().find_map(|root| {
                    resolved
                        .strip_prefix(root)
                        .ok()
                        .map(|rel| (root.clone(), rel.to_owned()))
                })
            });
        let Some((root, rel)) = found else {
            return Err(outside(path));
        };
        let dir = Dir::open_ambient_dir(&root, cap_std::ambient_authority())?;
        Ok((dir, rel))
    }
}

/// The refusal of a file outside the roots: the same words whether it
/// exists or not.
fn outside(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "{} is not under the directories this server reads from (--allow-root)",
            path.display()
        ),
    )
}

/// An open beneath a root that failed: one that would have left the root
/// (through a link, or `..`) says so, as [`outside`] does.
fn escaped(path: &Path, err: io::Error) -> io::Error {
    match err.kind() {
        io::ErrorKind::NotFound => err,
        io::ErrorKind::PermissionDenied => outside(path),
        _ if err.raw_os_error() == Some(EXDEV) => outside(path),
        _ => err,
    }
}

/// What `openat2` answers a path that leaves its root (Linux's `EXDEV`).
const EXDEV: i32 = 18;

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn links_out_of_the_root_are_refused_links_within_it_followed_and_walks_skip_links() {
        let tmp = tempfile::tempdir().unwrap();
        write(&tmp.path().join("root/data/a.parquet"), "a");
        write(&tmp.path().join("root/data/sub/b.parquet"), "b");
        write(&tmp.path().join("secret/s.parquet"), "secret");
        let root = tmp.path().join("root").canonicalize().unwrap();
        std::os::unix::fs::symlink(
            tmp.path().join("secret/s.parquet"),
            root.join("data/out.parquet"),
        )
        .unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret"), root.join("data/outdir")).unwrap();
        std::os::unix::fs::symlink("a.parquet", root.join("data/in.parquet")).unwrap();
        let confine = Confine::of(Some(std::slice::from_ref(&root)));
        let read = |p: &Path| {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut confine.open(p)?, &mut text)?;
            Ok::<_, io::Error>(text)
        };
        assert_eq!(read(&root.join("data/a.parquet")).unwrap(), "a");
        assert_eq!(read(&root.join("data/in.parquet")).unwrap(), "a");
        for out in [
            root.join("data/out.parquet"),
            root.join("data/outdir/s.parquet"),
            root.join("data/../../secret/s.parquet"),
            // Within the root too: `..` is refused as it stands.
            root.join("data/sub/../a.parquet"),
            tmp.path().join("secret/s.parquet"),
        ] {
            let err = read(&out).unwrap_err();
            assert!(
                err.to_string().contains("is not under the directories"),
                "{}: {err}",
                out.display()
            );
        }
        let parquet = |p: &Path| p.extension().is_some_and(|e| e == "parquet");
        let files = confine.files_under(&root.join("data"), &parquet).unwrap();
        assert_eq!(
            files,
            vec![root.join("data/a.parquet"), root.join("data/sub/b.parquet")]
        );
        // Not confined, links are followed as the user's own config wants.
        let free = Confine::default()
            .files_under(&root.join("data"), &parquet)
            .unwrap();
        assert_eq!(free.len(), 5, "{free:?}");
    }
}
