//! Child processes of a local control plane, kept in one process group.
//!
//! A watchdog (a tiny shell loop in its own process group) kills the whole group when
//! the process that started it exits for any reason, so a crashed or aborted test run
//! leaves nothing behind. An orderly [`ProcessGroup::stop`] terminates the group itself.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use std::os::unix::process::CommandExt;

/// A started component and where its output goes.
#[derive(Debug)]
pub struct Component {
    pub name: String,
    pub log: PathBuf,
    child: Child,
}

impl Component {
    /// Whether the process is still running; an exit is reported with its status.
    pub fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); last lines of {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 30)
            );
        }
        Ok(())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Processes that live and die together.
#[derive(Debug)]
pub struct ProcessGroup {
    pgid: u32,
    anchor: Child,
    watchdog: Child,
    components: Vec<Component>,
    stopped: bool,
}

impl ProcessGroup {
    /// Starts an empty group, anchored by a sleeping process that leads it, and a
    /// watchdog that tears it down when this process exits.
    pub fn new() -> Result<Self> {
        let anchor = Command::new("sleep")
            .arg("infinity")
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the process-group anchor (sleep)")?;
        let pgid = anchor.id();
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(concat!(
                "while kill -0 \"$0\" 2>/dev/null; do sleep 1; done; ",
                // `env kill`: the kill program, whose `--` ends options (dash's builtin has none).
                "env kill -TERM -- \"-$1\" 2>/dev/null; sleep 5; env kill -KILL -- \"-$1\" 2>/dev/null"
            ))
            .arg(std::process::id().to_string())
            .arg(pgid.to_string())
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the process-group watchdog (sh)")?;
        Ok(ProcessGroup {
            pgid,
            anchor,
            watchdog,
            components: Vec::new(),
            stopped: false,
        })
    }

    /// Starts `program` in the group, its stdout and stderr appended to `log`.
    pub fn spawn(&mut self, name: &str, program: &Path, args: &[String], log: &Path) -> Result<()> {
        self.spawn_with_env(name, program, args, log, &[])
    }

    /// Like [`ProcessGroup::spawn`], with extra environment variables.
    pub fn spawn_with_env(
        &mut self,
        name: &str,
        program: &Path,
        args: &[String],
        log: &Path,
        env: &[(&str, &str)],
    ) -> Result<()> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        let child = Command::new(program)
            .args(args)
            .envs(env.iter().copied())
            .process_group(self.pgid as i32)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        self.components.push(Component {
            name: name.to_string(),
            log: log.to_path_buf(),
            child,
        });
        Ok(())
    }

    /// Fails with the component's log tail if any component has exited.
    pub fn check_running(&mut self) -> Result<()> {
        self.components.iter_mut().try_for_each(Component::check_running)
    }

    /// Name and process id of every component.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.components.iter().map(|c| (c.name.clone(), c.pid())).collect()
    }

    pub fn component_mut(&mut self, name: &str) -> Option<&mut Component> {
        self.components.iter_mut().find(|c| c.name == name)
    }

    /// Sends `signal` (as `kill` names it: STOP, CONT, ...) to one component.
    pub fn signal_component(&self, name: &str, signal_name: &str) -> Result<()> {
        let Some(component) = self.components.iter().find(|c| c.name == name) else {
            bail!("no component named {name}");
        };
        signal(&component.pid().to_string(), signal_name);
        Ok(())
    }

    /// Terminates one component and waits for it to exit.
    pub fn stop_component(&mut self, name: &str, grace: Duration) -> Result<()> {
        let Some(index) = self.components.iter().position(|c| c.name == name) else {
            bail!("no component named {name}");
        };
        let mut component = self.components.remove(index);
        signal(&component.pid().to_string(), "TERM");
        wait_or_kill(&mut component.child, grace);
        Ok(())
    }

    /// Terminates every process of the group: SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        signal(&format!("-{}", self.pgid), "TERM");
        let deadline = Instant::now() + grace;
        for component in &mut self.components {
            wait_or_kill(&mut component.child, deadline.saturating_duration_since(Instant::now()));
        }
        signal(&format!("-{}", self.pgid), "KILL");
        let _ = self.anchor.wait();
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

fn signal(target: &str, signal: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), "--", target])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn wait_or_kill(child: &mut Child, grace: Duration) {
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The last `lines` lines of a log file, for error messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
