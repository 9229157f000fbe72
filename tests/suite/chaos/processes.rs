//! The run's worker processes: supervised slots, each a consumer or a relay, whose process is
//! replaced by a new generation when it dies, and the settings every process gets.

use super::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Role {
    Consumer,
    Relay,
}

/// One supervised process position: when its process dies, a new generation replaces it.
pub(super) struct Slot {
    pub(super) name: &'static str,
    pub(super) role: Role,
    /// Never killed or stopped: its memory and connections are the soak's measure.
    pub(super) witness: bool,
    pub(super) generation: u32,
    pub(super) worker: Worker,
    pub(super) worker_id: String,
    pub(super) armed: Option<String>,
    pub(super) stopped: bool,
    /// SIGKILLed by the driver (its fault and takeover are already recorded).
    pub(super) killed: bool,
}

pub(super) struct Cluster {
    pub(super) env: Vec<(String, String)>,
    /// More variables for the processes of one slot (by its name), after `env`.
    pub(super) extra: BTreeMap<&'static str, Vec<(String, String)>>,
    pub(super) logs: std::path::PathBuf,
    pub(super) slots: Vec<Slot>,
    /// Every log file ever written, for the final analysis.
    pub(super) all_logs: Vec<std::path::PathBuf>,
    /// When each process (by worker id) was seen dead or was killed.
    pub(super) ended: BTreeMap<String, DateTime<Utc>>,
}

impl Cluster {
    fn spawn(
        &mut self,
        name: &'static str,
        role: Role,
        generation: u32,
        armed: Option<String>,
    ) -> (Worker, String) {
        let id = format!("{name}-g{generation}");
        let log = self.logs.join(format!("{id}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
        let role_args: &[&str] = match role {
            Role::Consumer => &["--consumer"],
            Role::Relay => &["--relay", "--maintenance"],
        };
        cmd.args([
            "run",
            "--kinds",
            "probe,compile,deletion,research",
            "--worker-id",
            &id,
        ])
        .args(role_args)
        .stdout(std::process::Stdio::null())
        .stderr(file);
        for (k, v) in self
            .env
            .iter()
            .chain(self.extra.get(name).into_iter().flatten())
        {
            cmd.env(k, v);
        }
        if let Some(point) = &armed {
            cmd.env("KFS_CRASH_AT", point);
        }
        if role == Role::Consumer {
            cmd.env("KFS_CLOSE_CHANNEL_FILE", self.close_file(&id));
        }
        let child = cmd.spawn().expect("spawn kfs-worker");
        self.all_logs.push(log.clone());
        (
            Worker {
                child,
                log,
                name: id.clone(),
            },
            id,
        )
    }

    pub(super) fn add(&mut self, name: &'static str, role: Role, witness: bool) {
        let (worker, worker_id) = self.spawn(name, role, 0, None);
        self.slots.push(Slot {
            name,
            role,
            witness,
            generation: 0,
            worker,
            worker_id,
            armed: None,
            stopped: false,
            killed: false,
        });
    }

    /// The file whose appearance makes consumer `id` close one kind's channel (see
    /// [`close_a_channel`]).
    pub(super) fn close_file(&self, id: &str) -> std::path::PathBuf {
        self.logs.join(format!("{id}.close"))
    }

    /// Replaces the process of slot `i` with a new generation, armed at a kill point or not.
    pub(super) fn respawn(&mut self, i: usize, armed: Option<String>) {
        let (name, role, generation) = {
            let s = &self.slots[i];
            (s.name, s.role, s.generation + 1)
        };
        let (worker, worker_id) = self.spawn(name, role, generation, armed.clone());
        let s = &mut self.slots[i];
        s.generation = generation;
        s.worker = worker;
        s.worker_id = worker_id;
        s.armed = armed;
        s.stopped = false;
        s.killed = false;
    }
}

/// The worker settings of every run, beside where the services and the store are.
pub(super) fn worker_settings() -> Vec<(String, String)> {
    [
        ("KFS_LOG_FORMAT", "json"),
        (
            "RUST_LOG",
            "info,kfs_worker::ack=debug,sqlx=warn,lapin=error",
        ),
        ("KFS_LEASES", LEASE),
        ("KFS_SLICE_STEPS", "4"),
        ("KFS_RETRY_BASE", "200ms"),
        ("KFS_RETRY_MAX", "2s"),
        ("KFS_RELAY_POLL", "250ms"),
        ("KFS_VISIBILITY", "20s"),
        ("KFS_SHUTDOWN_GRACE", "5s"),
        ("KFS_CONNECT_TIMEOUT", "2s"),
        ("KFS_PREFETCH", "8"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}
