//! Tells the binary which commit it is built from (`quotad_build_info{revision}`):
//! `QUOTAD_REVISION` from the build's environment when set (a container build has no
//! `.git`: pass it as a build argument), else `git rev-parse --short=12 HEAD`, else
//! `unknown`. It reruns when the checked-out commit moves; only this small crate then
//! recompiles, never the daemon library.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=QUOTAD_REVISION");
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        let dir = PathBuf::from(dir);
        println!("cargo:rerun-if-changed={}", dir.join("HEAD").display());
        // Only files that exist: cargo reruns a script whose watched file is missing on
        // every build.
        let refs = git(&["symbolic-ref", "-q", "HEAD"]).map(|head| dir.join(head));
        for file in refs.into_iter().chain([dir.join("packed-refs")]) {
            if file.exists() {
                println!("cargo:rerun-if-changed={}", file.display());
            }
        }
    }
    let revision = std::env::var("QUOTAD_REVISION")
        .ok()
        .filter(|r| !r.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=QUOTAD_REVISION={revision}");
}
