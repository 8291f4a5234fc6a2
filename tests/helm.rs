//! Rendering the Helm chart as a user does (`helm template`), validating
//! what it renders offline against Kubernetes' schemas, and reading the
//! rendered documents.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use sleuth_testkit::find_tool;

pub fn chart_dir() -> std::path::PathBuf {
    sleuth_testkit::checkout_file("helm/sleuth")
}

pub fn helm_template(sets: &[&str]) -> Result<String> {
    helm_template_with(None, sets)
}

/// `helm template` with the chart's example values file `values` (e.g.
/// `values-l40s.yaml`) on top of the defaults, then `sets`.
pub fn helm_template_with(values: Option<&str>, sets: &[&str]) -> Result<String> {
    let mut command = Command::new(find_tool("helm")?);
    command.args(["template", "ci-release"]).arg(chart_dir());
    if let Some(values) = values {
        command.arg("-f").arg(chart_dir().join(values));
    }
    for set in sets {
        command.args(["--set", set]);
    }
    let output = command.output().context("running helm template")?;
    ensure!(output.status.success(), "helm template failed: {}", String::from_utf8_lossy(&output.stderr));
    Ok(String::from_utf8(output.stdout)?)
}

pub fn validate(manifests: &str) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("rendered.yaml");
    std::fs::write(&path, manifests)?;
    let output = Command::new(find_tool("kubernetes-validate")?).args(["--strict", "--quiet"]).arg(&path).output()?;
    ensure!(
        output.status.success(),
        "kubernetes-validate rejected the chart:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// (binary, SLEUTH_* variable names, readiness gRPC service) of each
/// Deployment or StatefulSet (the learner's ranks).
pub fn deployments(manifests: &str) -> Vec<(String, Vec<String>, Option<String>)> {
    manifests
        .split("\n---")
        .filter(|doc| doc.contains("\nkind: Deployment") || doc.contains("\nkind: StatefulSet"))
        .map(|doc| {
            // The service's own container, after the model's init container.
            let doc = doc.split("\n      containers:\n").nth(1).unwrap_or(doc);
            let binary = doc
                .lines()
                .find_map(|l| l.trim().strip_prefix("command: [\"/usr/local/bin/"))
                .map(|rest| rest.trim_end_matches("\"]").to_owned())
                .unwrap_or_default();
            let env = doc
                .lines()
                .filter_map(|l| l.trim().strip_prefix("- name: "))
                .filter(|name| name.starts_with("SLEUTH_"))
                .map(str::to_owned)
                .collect();
            let probe = doc.lines().find_map(|l| l.trim().strip_prefix("service: ")).map(str::to_owned);
            (binary, env, probe)
        })
        .collect()
}

/// The documents of a rendered chart.
pub fn documents(manifests: &str) -> Vec<&str> {
    manifests.split("\n---").collect()
}

/// The document of `kind` named `name`.
pub fn document<'a>(docs: &[&'a str], kind: &str, name: &str) -> Result<&'a str> {
    docs.iter()
        .find(|d| d.contains(&format!("\nkind: {kind}\n")) && d.contains(&format!("\n  name: {name}\n")))
        .copied()
        .with_context(|| format!("no {kind} {name}"))
}

/// The line after `- name: NAME` in `doc` (its `value:` or `valueFrom:`).
pub fn env_line(doc: &str, name: &str) -> Option<String> {
    let at = doc.find(&format!("- name: {name}\n"))?;
    doc[at..].lines().nth(1).map(|l| l.trim().to_owned())
}

/// Whether `doc` has `line`, indentation and a list item's `- ` aside.
pub fn has_line(doc: &str, line: &str) -> bool {
    doc.lines().any(|l| l.trim().trim_start_matches("- ") == line)
}
