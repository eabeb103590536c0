//! Starting, watching and stopping the TP rank processes.
//!
//! [`RankGroup::spawn`] starts N copies of the current executable (or
//! [`RankGroup::spawn_with`] any program), runs the control-channel handshake
//! (see [`super::channel`]) and then supervises them:
//!
//! - every child has stdin and stdout on `/dev/null` and stderr piped; a thread
//!   per child logs its stderr lines (`[rank r] …`) and keeps the last lines for
//!   error messages. **Rank processes must log to stderr.**
//! - on Linux each child gets `PR_SET_PDEATHSIG = SIGKILL`, so it dies with
//!   the driver. The children are forked from a thread that the group owns for
//!   its whole life (the death signal follows the *thread* that forked). On other
//!   systems a rank relies on control-channel EOF, which it must treat as "exit
//!   now" anyway.
//! - each child is the leader of its own process group: Ctrl-C in a terminal
//!   reaches only the driver, which then stops the ranks (or dies, and the death
//!   signal kills them); signals to a rank go to its whole group, so helpers it
//!   started go with it.
//! - a watcher thread polls the children every 50 ms. Any rank that exits
//!   while the group is not being shut down is a failure: the group records it
//!   (the first failure wins), sends SIGTERM to all other ranks and SIGKILL
//!   after the grace period, and every later call returns that failure.
//!   A receive that times out or a channel that breaks fails the group the same
//!   way. With the default 2 s grace all ranks are gone within ~2.2 s of a
//!   failure being detected.
//! - with [`LaunchOptions::heartbeat_timeout`], every rank sends an empty
//!   frame (a heartbeat) every [`channel::HEARTBEAT_PERIOD`] from a thread of
//!   its own (see [`channel::Channel::start_heartbeat`]); the reader threads
//!   note them, and the watcher fails the group, naming the rank, when one
//!   has been silent that long: a stopped (SIGSTOP) or frozen rank is found
//!   whether a step is running or not, and a long step (a kernel warm-up, a
//!   long prefill) is no false alarm, the heartbeat thread runs meanwhile.
//! - [`RankGroup::recv_all_within`] has a straggler deadline too: once one
//!   rank has answered, the others must answer within it, else the first
//!   rank still silent is blamed (a rank whose heartbeat runs but whose step
//!   is stuck).
//! - [`RankGroup::shutdown`] and `Drop` stop everything (EOF, SIGTERM, SIGKILL
//!   after the grace period) and reap every child: no process is left behind.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::channel::{
    self, Channel, ChannelError, Hello, HelloReply, IdentityMismatch, CONTROL_ADDR_VAR,
    CONTROL_RANK_VAR, CONTROL_SECRET_VAR,
};

const WATCH_PERIOD: Duration = Duration::from_millis(50);
/// When a step's answers are late, a rank this long without a heartbeat (four periods:
/// its heartbeat thread runs even while it computes) is blamed as the cause, before the
/// heartbeat timeout itself would find it.
const SILENT_BLAME: Duration = channel::HEARTBEAT_PERIOD.saturating_mul(4);
/// How long a failure report waits for the stderr reader to catch up.
const STDERR_SETTLE: Duration = Duration::from_millis(300);
/// How long a broken channel waits for the process exit to show.
const EXIT_SETTLE: Duration = Duration::from_millis(500);
const MAX_LINE: usize = 4096;

/// Knobs of a [`RankGroup`].
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// How long all ranks together have to connect and say hello.
    pub startup_timeout: Duration,
    /// Time between SIGTERM and SIGKILL when stopping ranks.
    pub grace: Duration,
    /// How long a send may block on a rank that does not read.
    pub send_timeout: Duration,
    /// How many stderr lines per rank are kept for error messages.
    pub stderr_tail_lines: usize,
    /// Fail the group when a connected rank sends no heartbeat for this long
    /// (`None`: ranks send none).
    pub heartbeat_timeout: Option<Duration>,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        Self {
            startup_timeout: Duration::from_secs(60),
            grace: Duration::from_secs(2),
            send_timeout: Duration::from_secs(30),
            stderr_tail_lines: 20,
            heartbeat_timeout: None,
        }
    }
}

/// A rank failure, or a failure to start or talk to the ranks.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RankError {
    #[error("could not start TP rank {rank} ({program}): {reason}")]
    Spawn {
        rank: usize,
        program: String,
        reason: String,
    },
    #[error("could not open the TP control listener on 127.0.0.1: {0}")]
    Listen(String),
    #[error("TP rank {rank} exited ({status}){}", tail_text(.stderr_tail))]
    Died {
        rank: usize,
        status: ExitStatus,
        stderr_tail: Vec<String>,
    },
    #[error(
        "TP rank {rank} sent nothing for {after:?}: it is hung or too slow; all ranks were \
         stopped{}", tail_text(.stderr_tail)
    )]
    Timeout {
        rank: usize,
        after: Duration,
        stderr_tail: Vec<String>,
    },
    #[error(
        "TP rank {rank} sent no heartbeat for {silent:.1?}: it is stopped, frozen or starved \
         of CPU; all ranks were stopped{}", tail_text(.stderr_tail)
    )]
    HeartbeatLost {
        rank: usize,
        silent: Duration,
        stderr_tail: Vec<String>,
    },
    #[error(
        "TP rank {rank} did not finish the step within {after:?} of rank {first}: it is stuck \
         or far too slow; all ranks were stopped{}", tail_text(.stderr_tail)
    )]
    Straggler {
        rank: usize,
        first: usize,
        after: Duration,
        stderr_tail: Vec<String>,
    },
    #[error(
        "TP rank {rank} did not connect to the driver within {after:?}{}{}",
        rejected_text(.rejected),
        tail_text(.stderr_tail)
    )]
    StartupTimeout {
        rank: usize,
        after: Duration,
        rejected: usize,
        stderr_tail: Vec<String>,
    },
    #[error("TP rank {rank} failed the start-up handshake: {reason}")]
    Handshake { rank: usize, reason: String },
    #[error(
        "TP rank {rank} does not match rank 0: {what}; every rank must load the same model \
         with the same settings"
    )]
    IdentityMismatch { rank: usize, what: String },
    #[error("TP rank {rank} closed its control channel while running: {reason}{}", tail_text(.stderr_tail))]
    Disconnected {
        rank: usize,
        reason: String,
        stderr_tail: Vec<String>,
    },
    #[error("could not send to TP rank {rank}: {reason}{}", tail_text(.stderr_tail))]
    Send {
        rank: usize,
        reason: String,
        stderr_tail: Vec<String>,
    },
    #[error("bad control message from TP rank {rank}: {reason}")]
    Protocol { rank: usize, reason: String },
    #[error("the TP rank group was shut down")]
    ShutDown,
}

impl RankError {
    /// The rank the error is about, if any.
    pub fn rank(&self) -> Option<usize> {
        match self {
            RankError::Spawn { rank, .. }
            | RankError::Died { rank, .. }
            | RankError::Timeout { rank, .. }
            | RankError::HeartbeatLost { rank, .. }
            | RankError::Straggler { rank, .. }
            | RankError::StartupTimeout { rank, .. }
            | RankError::Handshake { rank, .. }
            | RankError::IdentityMismatch { rank, .. }
            | RankError::Disconnected { rank, .. }
            | RankError::Send { rank, .. }
            | RankError::Protocol { rank, .. } => Some(*rank),
            RankError::Listen(_) | RankError::ShutDown => None,
        }
    }
}

fn rejected_text(rejected: &usize) -> String {
    if *rejected == 0 {
        return String::new();
    }
    format!(" ({rejected} connection(s) with a wrong secret were refused)")
}

fn tail_text(tail: &[String]) -> String {
    if tail.is_empty() {
        return "; it wrote nothing to stderr".to_string();
    }
    let mut s = String::from("; its last stderr lines:");
    for line in tail {
        s.push_str("\n    ");
        s.push_str(line);
    }
    s
}

/// Ports that were free on 127.0.0.1 a moment ago (for `NCCL_PORT` or a ring
/// `MLX_HOSTFILE`). They are all bound at once, so they are distinct, then
/// released: another process may take one before the rank binds it. Callers
/// that see a bind failure in a rank should pick new ports and start again.
pub fn pick_free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

// ---------------------------------------------------------------- internals

/// The last stderr lines of one child.
struct Tail {
    state: Mutex<(VecDeque<String>, bool)>, // (lines, reader done)
    done: Condvar,
    cap: usize,
}

impl Tail {
    fn new(cap: usize) -> Self {
        Self {
            state: Mutex::new((VecDeque::new(), false)),
            done: Condvar::new(),
            cap: cap.max(1),
        }
    }

    fn push(&self, line: String) {
        let mut st = lock(&self.state);
        if st.0.len() == self.cap {
            st.0.pop_front();
        }
        st.0.push_back(line);
    }

    fn finish(&self) {
        lock(&self.state).1 = true;
        self.done.notify_all();
    }

    fn wait_done(&self, timeout: Duration) -> bool {
        let st = lock(&self.state);
        let (st, _) = self
            .done
            .wait_timeout_while(st, timeout, |st| !st.1)
            .unwrap_or_else(|e| e.into_inner());
        st.1
    }

    fn lines(&self) -> Vec<String> {
        lock(&self.state).0.iter().cloned().collect()
    }

    /// The lines once the child's stderr is at EOF (or after a short wait).
    fn settled_lines(&self) -> Vec<String> {
        self.wait_done(STDERR_SETTLE);
        self.lines()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

fn forward_stderr(rank: usize, stderr: ChildStderr, tail: Arc<Tail>) {
    let mut reader = BufReader::new(stderr);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let raw = String::from_utf8_lossy(&buf);
                let mut line = strip_ansi(raw.trim_end_matches(['\n', '\r']));
                if line.len() > MAX_LINE {
                    let mut cut = MAX_LINE;
                    while !line.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    line.truncate(cut);
                    line.push('…');
                }
                if line.contains(" ERROR ") || line.starts_with("ERROR") {
                    tracing::error!(target: "mlxcel::rank", "[rank {rank}] {line}");
                } else if line.contains(" WARN ") || line.starts_with("WARN") {
                    tracing::warn!(target: "mlxcel::rank", "[rank {rank}] {line}");
                } else {
                    tracing::info!(target: "mlxcel::rank", "[rank {rank}] {line}");
                }
                tail.push(line);
            }
        }
    }
    tail.finish();
}

struct Proc {
    child: Child,
    pid: u32,
    /// Set once reaped; a reaped pid is never signalled again.
    exit: Option<ExitStatus>,
}

enum Event {
    Frame(usize, Vec<u8>),
    Closed(usize, String),
    /// Something failed; look at `Shared::failure`.
    Failed,
}

struct Shared {
    procs: Mutex<Vec<Proc>>,
    tails: Vec<Arc<Tail>>,
    failure: Mutex<Option<RankError>>,
    /// A deliberate shutdown: exits are expected, not failures.
    stopping: AtomicBool,
    /// When still-running children get SIGKILL (set once termination starts).
    kill_at: Mutex<Option<Instant>>,
    /// When each rank's last heartbeat (or any frame) arrived.
    beats: Mutex<Vec<Instant>>,
    /// Set once the handshake is done and the ranks send heartbeats.
    beating: AtomicBool,
    heartbeat_timeout: Option<Duration>,
}

impl Shared {
    fn failure(&self) -> Option<RankError> {
        lock(&self.failure).clone()
    }

    /// Records `err` unless a failure was recorded first; returns the failure
    /// that stands.
    fn fail(&self, err: RankError) -> RankError {
        let mut f = lock(&self.failure);
        if f.is_none() {
            tracing::error!("{err}");
            *f = Some(err);
        }
        f.clone().unwrap()
    }

    fn exited(&self, rank: usize) -> Option<ExitStatus> {
        lock(&self.procs)[rank].exit
    }

    /// Reaps whatever has exited; returns the newly exited ranks.
    fn poll(&self) -> Vec<(usize, ExitStatus)> {
        let mut out = Vec::new();
        for (rank, p) in lock(&self.procs).iter_mut().enumerate() {
            if p.exit.is_none() {
                if let Ok(Some(status)) = p.child.try_wait() {
                    p.exit = Some(status);
                    out.push((rank, status));
                }
            }
        }
        out
    }

    fn signal_live(&self, sig: libc::c_int) {
        for p in lock(&self.procs).iter() {
            if p.exit.is_none() {
                // Not reaped yet, so the pid (and its group id) is still ours.
                let pid = p.pid as libc::pid_t;
                // SAFETY: plain kill(2) on our own unreaped child / its group.
                unsafe {
                    if libc::kill(-pid, sig) != 0 {
                        libc::kill(pid, sig);
                    }
                }
            }
        }
    }

    /// SIGKILL to one live child (a rank that cannot act on SIGTERM: stopped or frozen).
    fn kill(&self, rank: usize) {
        if let Some(p) = lock(&self.procs).get(rank) {
            if p.exit.is_none() {
                let pid = p.pid as libc::pid_t;
                // SAFETY: plain kill(2) on our own unreaped child / its group.
                unsafe {
                    if libc::kill(-pid, libc::SIGKILL) != 0 {
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
            }
        }
    }

    /// Starts stopping every live child: SIGTERM now, SIGKILL after `grace`
    /// (an earlier SIGKILL time already set stands).
    fn terminate(&self, grace: Duration) {
        let at = Instant::now() + grace;
        {
            let mut k = lock(&self.kill_at);
            match *k {
                Some(t) if t <= at => {}
                _ => *k = Some(at),
            }
        }
        self.signal_live(libc::SIGTERM);
    }

    fn all_reaped(&self) -> bool {
        lock(&self.procs).iter().all(|p| p.exit.is_some())
    }

    fn beat(&self, rank: usize) {
        if let Some(t) = lock(&self.beats).get_mut(rank) {
            *t = Instant::now();
        }
    }

    /// The live rank silent for longest, if silent past the heartbeat timeout.
    fn silent_rank(&self) -> Option<(usize, Duration)> {
        self.silent_rank_past(self.heartbeat_timeout?)
    }

    /// The live rank silent for longest, if silent past `limit` (heartbeats on).
    fn silent_rank_past(&self, limit: Duration) -> Option<(usize, Duration)> {
        if self.heartbeat_timeout.is_none() || !self.beating.load(Ordering::SeqCst) {
            return None;
        }
        let procs = lock(&self.procs);
        lock(&self.beats)
            .iter()
            .enumerate()
            .filter(|(rank, _)| procs[*rank].exit.is_none())
            .map(|(rank, t)| (rank, t.elapsed()))
            .filter(|(_, silent)| *silent > limit)
            .max_by_key(|(_, silent)| *silent)
    }
}

/// Polls the children until all are reaped; turns an unexpected exit into the
/// group's failure and stops the others.
fn watch(shared: Arc<Shared>, events: Sender<Event>, grace: Duration) {
    let mut killed = false;
    loop {
        let mut deaths = shared.poll();
        if !deaths.is_empty()
            && !shared.stopping.load(Ordering::SeqCst)
            && lock(&shared.failure).is_none()
        {
            // A peer that loses its partner exits soon after it: gather the deaths of the
            // next moment too and blame a rank killed by a signal (the likely root cause)
            // before one that exited on its own.
            std::thread::sleep(Duration::from_millis(100));
            deaths.extend(shared.poll());
            use std::os::unix::process::ExitStatusExt;
            deaths.sort_by_key(|(rank, st)| (st.signal().is_none(), *rank));
        }
        if deaths.is_empty()
            && !shared.stopping.load(Ordering::SeqCst)
            && lock(&shared.failure).is_none()
        {
            if let Some((rank, silent)) = shared.silent_rank() {
                let stderr_tail = shared.tails[rank].lines();
                let err = RankError::HeartbeatLost {
                    rank,
                    silent,
                    stderr_tail,
                };
                fail_group(&shared, err, grace, &events);
                // a stopped or frozen rank would sit out the grace period
                shared.kill(rank);
            }
        }
        for (rank, status) in deaths {
            let expected =
                shared.stopping.load(Ordering::SeqCst) || lock(&shared.failure).is_some();
            if expected {
                tracing::debug!("TP rank {rank} exited ({status})");
                continue;
            }
            let stderr_tail = shared.tails[rank].settled_lines();
            let err = RankError::Died {
                rank,
                status,
                stderr_tail,
            };
            fail_group(&shared, err, grace, &events);
        }
        if shared.all_reaped() {
            return;
        }
        if !killed {
            let due = matches!(*lock(&shared.kill_at), Some(t) if Instant::now() >= t);
            if due {
                tracing::warn!("TP ranks still running after the grace period: sending SIGKILL");
                shared.signal_live(libc::SIGKILL);
                killed = true;
            }
        }
        std::thread::sleep(WATCH_PERIOD);
    }
}

/// Records `err` as the group's failure, starts stopping every rank and wakes the driver.
fn fail_group(shared: &Shared, err: RankError, grace: Duration, events: &Sender<Event>) {
    shared.fail(err);
    shared.terminate(grace);
    let _ = events.send(Event::Failed);
}

fn read_frames(rank: usize, mut ch: Channel, events: Sender<Event>, shared: Arc<Shared>) {
    loop {
        match ch.recv_frame() {
            Ok(frame) => {
                shared.beat(rank);
                if frame.is_empty() {
                    continue; // a heartbeat
                }
                if events.send(Event::Frame(rank, frame)).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = events.send(Event::Closed(rank, e.to_string()));
                return;
            }
        }
    }
}

/// Forks the children from a thread that lives as long as the group, so the
/// Linux parent-death signal (tied to the forking thread) fires only when the
/// driver process dies.
/// The spawn results, the keeper's release handle and the keeper thread.
type Spawned = (Vec<std::io::Result<Child>>, Sender<()>, JoinHandle<()>);

fn spawn_on_keeper(cmds: Vec<Command>) -> std::io::Result<Spawned> {
    let (result_tx, result_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let handle = std::thread::Builder::new()
        .name("mlxcel-rank-keeper".into())
        .spawn(move || {
            let children: Vec<_> = cmds.into_iter().map(|mut c| c.spawn()).collect();
            let _ = result_tx.send(children);
            // Returns when the group drops the sender, after reaping.
            let _ = release_rx.recv();
        })?;
    let children = result_rx
        .recv()
        .map_err(|_| std::io::Error::other("the rank spawner thread panicked"))?;
    Ok((children, release_tx, handle))
}

fn rank_command(program: &OsStr, args: &[OsString], env: &[(String, String)]) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                #[cfg(target_os = "linux")]
                {
                    if libc::prctl(
                        libc::PR_SET_PDEATHSIG,
                        libc::SIGKILL as libc::c_ulong,
                        0,
                        0,
                        0,
                    ) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // The driver died before the death signal was armed.
                if libc::getppid() != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    cmd
}

// ---------------------------------------------------------------- the group

/// N rank processes, connected and supervised. See the module docs.
pub struct RankGroup {
    shared: Arc<Shared>,
    opts: LaunchOptions,
    /// Write halves of the control channels, by rank (empty until the
    /// handshake is done).
    writers: Vec<Channel>,
    identities: Vec<serde_json::Value>,
    pending: Vec<VecDeque<Vec<u8>>>,
    events: Receiver<Event>,
    events_tx: Option<Sender<Event>>,
    watcher: Option<JoinHandle<()>>,
    readers: Vec<JoinHandle<()>>,
    stderr_threads: Vec<JoinHandle<()>>,
    keeper: Option<(Sender<()>, JoinHandle<()>)>,
    pids: Vec<u32>,
    shut_down: bool,
}

impl RankGroup {
    /// Starts `rank_envs.len()` copies of the current executable with `args`;
    /// rank `r` gets the pairs `rank_envs[r]` plus the control variables on
    /// top of this process's environment. Returns once every rank connected
    /// and `check` accepted their identities (see [`channel::identities_agree`]).
    pub fn spawn<A: AsRef<OsStr>>(
        args: &[A],
        rank_envs: Vec<Vec<(String, String)>>,
        opts: &LaunchOptions,
        check: impl FnOnce(&[serde_json::Value]) -> Result<(), IdentityMismatch>,
    ) -> Result<Self, RankError> {
        let exe = std::env::current_exe().map_err(|e| RankError::Spawn {
            rank: 0,
            program: "the current executable".into(),
            reason: format!("cannot locate it: {e}"),
        })?;
        Self::spawn_with(exe.as_os_str(), args, rank_envs, opts, check)
    }

    /// [`spawn`](Self::spawn) with another program (tests, helpers).
    pub fn spawn_with<A: AsRef<OsStr>>(
        program: &OsStr,
        args: &[A],
        rank_envs: Vec<Vec<(String, String)>>,
        opts: &LaunchOptions,
        check: impl FnOnce(&[serde_json::Value]) -> Result<(), IdentityMismatch>,
    ) -> Result<Self, RankError> {
        let n = rank_envs.len();
        let listener =
            TcpListener::bind("127.0.0.1:0").map_err(|e| RankError::Listen(e.to_string()))?;
        let addr = listener
            .local_addr()
            .map_err(|e| RankError::Listen(e.to_string()))?
            .to_string();
        listener
            .set_nonblocking(true)
            .map_err(|e| RankError::Listen(e.to_string()))?;
        let secret = channel::new_secret();
        let args: Vec<OsString> = args.iter().map(|a| a.as_ref().to_os_string()).collect();
        let program_name = program.to_string_lossy().into_owned();

        let cmds = rank_envs
            .iter()
            .enumerate()
            .map(|(rank, env)| {
                let mut env = env.clone();
                env.push((CONTROL_ADDR_VAR.into(), addr.clone()));
                env.push((CONTROL_SECRET_VAR.into(), secret.clone()));
                env.push((CONTROL_RANK_VAR.into(), rank.to_string()));
                rank_command(program, &args, &env)
            })
            .collect();
        let (spawned, release, keeper) = spawn_on_keeper(cmds).map_err(|e| RankError::Spawn {
            rank: 0,
            program: program_name.clone(),
            reason: e.to_string(),
        })?;

        let mut procs = Vec::new();
        let mut tails = Vec::new();
        let mut stderr_threads = Vec::new();
        let mut spawn_err = None;
        for (rank, res) in spawned.into_iter().enumerate() {
            match res {
                Ok(mut child) => {
                    let tail = Arc::new(Tail::new(opts.stderr_tail_lines));
                    if let Some(stderr) = child.stderr.take() {
                        let t = tail.clone();
                        if let Ok(h) = std::thread::Builder::new()
                            .name(format!("mlxcel-rank{rank}-stderr"))
                            .spawn(move || forward_stderr(rank, stderr, t))
                        {
                            stderr_threads.push(h);
                        }
                    }
                    tracing::debug!(rank, pid = child.id(), "started TP rank");
                    procs.push(Proc {
                        pid: child.id(),
                        child,
                        exit: None,
                    });
                    tails.push(tail);
                }
                Err(e) => {
                    if spawn_err.is_none() {
                        spawn_err = Some(RankError::Spawn {
                            rank,
                            program: program_name.clone(),
                            reason: e.to_string(),
                        });
                    }
                }
            }
        }
        let pids = procs.iter().map(|p| p.pid).collect();
        let shared = Arc::new(Shared {
            procs: Mutex::new(procs),
            tails,
            failure: Mutex::new(None),
            stopping: AtomicBool::new(false),
            kill_at: Mutex::new(None),
            beats: Mutex::new(vec![Instant::now(); n]),
            beating: AtomicBool::new(false),
            heartbeat_timeout: opts.heartbeat_timeout,
        });
        let (events_tx, events) = mpsc::channel();
        let mut group = RankGroup {
            shared: shared.clone(),
            opts: opts.clone(),
            writers: Vec::new(),
            identities: Vec::new(),
            pending: vec![VecDeque::new(); n],
            events,
            events_tx: Some(events_tx.clone()),
            watcher: None,
            readers: Vec::new(),
            stderr_threads,
            keeper: Some((release, keeper)),
            pids,
            shut_down: false,
        };
        if let Some(e) = spawn_err {
            return Err(group.fail(e)); // Drop stops what did start.
        }
        let grace = opts.grace;
        let watcher = std::thread::Builder::new()
            .name("mlxcel-rank-watcher".into())
            .spawn(move || watch(shared, events_tx, grace))
            .map_err(|e| RankError::Spawn {
                rank: 0,
                program: program_name.clone(),
                reason: format!("cannot start the watcher thread: {e}"),
            });
        match watcher {
            Ok(h) => group.watcher = Some(h),
            Err(e) => return Err(group.fail(e)),
        }

        let conns = group.accept_ranks(&listener, &secret, n)?;
        drop(listener);
        let (mut chans, identities): (Vec<Channel>, Vec<serde_json::Value>) =
            conns.into_iter().unzip();
        if let Err(m) = check(&identities) {
            let reason = format!("rank {} does not match rank 0: {}", m.rank, m.what);
            for ch in &mut chans {
                let _ = ch.send(&HelloReply::Rejected {
                    reason: reason.clone(),
                });
            }
            return Err(group.fail(RankError::IdentityMismatch {
                rank: m.rank,
                what: m.what,
            }));
        }
        for (rank, ch) in chans.iter_mut().enumerate() {
            let _ = ch.set_write_timeout(Some(opts.send_timeout));
            if let Err(e) = ch.send(&HelloReply::Accepted { world_size: n }) {
                return Err(group.send_failed(rank, e));
            }
        }
        for (rank, ch) in chans.iter_mut().enumerate() {
            let reader = match ch.split_reader() {
                Ok(r) => r,
                Err(e) => return Err(group.send_failed(rank, e)),
            };
            let tx = group.events_tx.clone().unwrap();
            let shared = group.shared.clone();
            match std::thread::Builder::new()
                .name(format!("mlxcel-rank{rank}-reader"))
                .spawn(move || read_frames(rank, reader, tx, shared))
            {
                Ok(h) => group.readers.push(h),
                Err(e) => {
                    return Err(group.fail(RankError::Handshake {
                        rank,
                        reason: format!("cannot start its reader thread: {e}"),
                    }))
                }
            }
        }
        group.writers = chans;
        group.identities = identities;
        *lock(&group.shared.beats) = vec![Instant::now(); n];
        group.shared.beating.store(true, Ordering::SeqCst);
        // Only the watcher and readers hold senders now, so `recv` sees a
        // disconnect once they are all gone.
        group.events_tx = None;
        tracing::info!("{n} TP rank(s) connected");
        Ok(group)
    }

    /// Accepts one hello per rank; refuses connections with a wrong secret.
    fn accept_ranks(
        &mut self,
        listener: &TcpListener,
        secret: &str,
        n: usize,
    ) -> Result<Vec<(Channel, serde_json::Value)>, RankError> {
        let deadline = Instant::now() + self.opts.startup_timeout;
        let mut conns: Vec<Option<(Channel, serde_json::Value)>> = (0..n).map(|_| None).collect();
        let mut rejected = 0;
        while conns.iter().any(Option::is_none) {
            if let Some(f) = self.shared.failure() {
                return Err(f);
            }
            let now = Instant::now();
            if now >= deadline {
                let rank = conns.iter().position(Option::is_none).unwrap();
                let err = RankError::StartupTimeout {
                    rank,
                    after: self.opts.startup_timeout,
                    rejected,
                    stderr_tail: self.shared.tails[rank].lines(),
                };
                return Err(self.fail(err));
            }
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                Err(e) => {
                    tracing::warn!("control listener accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let peer = stream
                .peer_addr()
                .map(|a| a.to_string())
                .unwrap_or_default();
            let hello = stream
                .set_nonblocking(false)
                .map_err(ChannelError::from)
                .and_then(|_| Channel::new(stream))
                .and_then(|mut ch| {
                    let wait = deadline
                        .saturating_duration_since(now)
                        .min(Duration::from_secs(5))
                        .max(Duration::from_millis(1));
                    let h = ch.recv_timeout::<Hello>(wait)?;
                    Ok((ch, h))
                });
            let (mut ch, hello) = match hello {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(
                        "dropped a control connection from {peer}: no valid hello ({e})"
                    );
                    continue;
                }
            };
            if !channel::secrets_match(&hello.secret, secret) {
                rejected += 1;
                tracing::warn!(
                    "refused a control connection from {peer} claiming rank {}: wrong secret",
                    hello.rank
                );
                let _ = ch.send(&HelloReply::Rejected {
                    reason: "wrong secret".into(),
                });
                continue;
            }
            if hello.rank >= n {
                return Err(self.fail(RankError::Handshake {
                    rank: hello.rank,
                    reason: format!("rank out of range: the group has {n} rank(s)"),
                }));
            }
            if conns[hello.rank].is_some() {
                return Err(self.fail(RankError::Handshake {
                    rank: hello.rank,
                    reason: "it connected twice".into(),
                }));
            }
            tracing::debug!(rank = hello.rank, "TP rank said hello");
            conns[hello.rank] = Some((ch, hello.identity));
        }
        Ok(conns.into_iter().map(Option::unwrap).collect())
    }

    /// Records a failure (unless one came first), starts stopping all ranks,
    /// and returns the failure that stands.
    fn fail(&mut self, err: RankError) -> RankError {
        let f = self.shared.fail(err);
        self.shared.terminate(self.opts.grace);
        f
    }

    /// A send error: a dying rank's exit status explains it better.
    fn send_failed(&mut self, rank: usize, e: ChannelError) -> RankError {
        let until = Instant::now() + EXIT_SETTLE;
        while Instant::now() < until {
            if let Some(f) = self.shared.failure() {
                return f;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let stderr_tail = self.shared.tails[rank].lines();
        self.fail(RankError::Send {
            rank,
            reason: e.to_string(),
            stderr_tail,
        })
    }

    /// The channel of `rank` broke: report its exit if it is exiting.
    fn closed(&mut self, rank: usize, reason: String) -> RankError {
        let start = Instant::now();
        loop {
            if let Some(f) = self.shared.failure() {
                return f;
            }
            // Once the exit shows, the watcher turns it into the failure
            // (after reading the last stderr lines): wait for that.
            let limit = if self.shared.exited(rank).is_some() {
                EXIT_SETTLE * 6
            } else {
                EXIT_SETTLE
            };
            if start.elapsed() >= limit {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let stderr_tail = self.shared.tails[rank].lines();
        self.fail(RankError::Disconnected {
            rank,
            reason,
            stderr_tail,
        })
    }

    fn ensure_usable(&self) -> Result<(), RankError> {
        if let Some(f) = self.shared.failure() {
            return Err(f);
        }
        if self.shut_down {
            return Err(RankError::ShutDown);
        }
        Ok(())
    }

    pub fn world_size(&self) -> usize {
        self.pids.len()
    }

    /// The process ids of the ranks, by rank.
    pub fn pids(&self) -> Vec<u32> {
        self.pids.clone()
    }

    /// The identities the ranks sent in their hello, by rank.
    pub fn identities(&self) -> &[serde_json::Value] {
        &self.identities
    }

    /// The last stderr lines of `rank` so far.
    pub fn stderr_tail(&self, rank: usize) -> Vec<String> {
        self.shared.tails[rank].lines()
    }

    /// The failure that stopped the group, if any.
    pub fn failure(&self) -> Option<RankError> {
        self.shared.failure()
    }

    /// Processes what arrived without waiting; `Err` if the group failed.
    pub fn check_health(&mut self) -> Result<(), RankError> {
        self.ensure_usable()?;
        while let Ok(ev) = self.events.try_recv() {
            self.handle(ev)?;
        }
        self.ensure_usable()
    }

    /// Sends one raw frame to `rank`.
    pub fn send_frame_to(&mut self, rank: usize, frame: &[u8]) -> Result<(), RankError> {
        self.ensure_usable()?;
        if let Err(e) = self.writers[rank].send_frame(frame) {
            return Err(self.send_failed(rank, e));
        }
        Ok(())
    }

    /// Sends a typed message to `rank`.
    pub fn send_to<T: Serialize + ?Sized>(
        &mut self,
        rank: usize,
        msg: &T,
    ) -> Result<(), RankError> {
        let frame = self.encode(msg)?;
        self.send_frame_to(rank, &frame)
    }

    /// Sends the same message to every rank (encoded once), in rank order.
    pub fn broadcast<T: Serialize + ?Sized>(&mut self, msg: &T) -> Result<(), RankError> {
        let frame = self.encode(msg)?;
        for rank in 0..self.writers.len() {
            self.send_frame_to(rank, &frame)?;
        }
        Ok(())
    }

    fn encode<T: Serialize + ?Sized>(&self, msg: &T) -> Result<Vec<u8>, RankError> {
        channel::encode(msg).map_err(|e| RankError::Protocol {
            rank: 0,
            reason: format!("cannot encode the message for the ranks: {e}"),
        })
    }

    fn handle(&mut self, ev: Event) -> Result<(), RankError> {
        match ev {
            Event::Frame(rank, frame) => {
                self.pending[rank].push_back(frame);
                Ok(())
            }
            Event::Closed(rank, reason) => Err(self.closed(rank, reason)),
            Event::Failed => match self.shared.failure() {
                Some(f) => Err(f),
                None => Ok(()),
            },
        }
    }

    /// Waits until `ready` finds what it needs in the pending frames, handling
    /// events; a rank's death fails the wait at once, silence past `timeout`
    /// fails it with a [`RankError::Timeout`] naming `blame(pending)`.
    fn wait_for(
        &mut self,
        timeout: Duration,
        straggler: Option<Duration>,
        ready: impl Fn(&[VecDeque<Vec<u8>>]) -> bool,
        blame: impl Fn(&[VecDeque<Vec<u8>>]) -> usize,
    ) -> Result<(), RankError> {
        let deadline = Instant::now() + timeout;
        // (when, which rank) the first answer was there
        let mut first: Option<(Instant, usize)> = None;
        loop {
            self.ensure_usable()?;
            if ready(&self.pending) {
                return Ok(());
            }
            if first.is_none() {
                if let Some(r) = self.pending.iter().position(|q| !q.is_empty()) {
                    first = Some((Instant::now(), r));
                }
            }
            let straggler_due = match (straggler, first) {
                (Some(s), Some((t, _))) => Some(t + s),
                _ => None,
            };
            let until = straggler_due.map_or(deadline, |d| d.min(deadline));
            let left = until.saturating_duration_since(Instant::now());
            let ev = if left.is_zero() {
                self.events
                    .try_recv()
                    .map_err(|_| RecvTimeoutError::Timeout)
            } else {
                self.events.recv_timeout(left)
            };
            match ev {
                Ok(ev) => self.handle(ev)?,
                Err(RecvTimeoutError::Timeout) => {
                    let now = Instant::now();
                    if now < until {
                        continue;
                    }
                    // a rank whose heartbeats stopped is the cause (the others wait for it
                    // in a collective), whichever rank is late with its answer
                    if let Some((rank, silent)) = self.shared.silent_rank_past(SILENT_BLAME) {
                        let stderr_tail = self.shared.tails[rank].lines();
                        let err = RankError::HeartbeatLost {
                            rank,
                            silent,
                            stderr_tail,
                        };
                        return Err(self.fail(err));
                    }
                    let rank = blame(&self.pending);
                    let stderr_tail = self.shared.tails[rank].lines();
                    let err = match (straggler, first) {
                        (Some(after), Some((_, first))) if now < deadline => RankError::Straggler {
                            rank,
                            first,
                            after,
                            stderr_tail,
                        },
                        _ => RankError::Timeout {
                            rank,
                            after: timeout,
                            stderr_tail,
                        },
                    };
                    return Err(self.fail(err));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.shared.failure().unwrap_or(RankError::ShutDown));
                }
            }
        }
    }

    /// The next raw frame from `rank`. Frames other ranks send meanwhile are
    /// kept for later; any rank's failure ends the wait with that failure.
    /// A timeout is fatal: the group is stopped (ranks that disagree on
    /// progress would deadlock in their collectives).
    pub fn recv_frame_from(
        &mut self,
        rank: usize,
        timeout: Duration,
    ) -> Result<Vec<u8>, RankError> {
        self.wait_for(timeout, None, |p| !p[rank].is_empty(), |_| rank)?;
        Ok(self.pending[rank].pop_front().unwrap())
    }

    /// The next typed message from `rank` (see [`recv_frame_from`](Self::recv_frame_from)).
    pub fn recv_from<T: DeserializeOwned>(
        &mut self,
        rank: usize,
        timeout: Duration,
    ) -> Result<T, RankError> {
        let frame = self.recv_frame_from(rank, timeout)?;
        self.decode(rank, &frame)
    }

    /// One raw frame from every rank, by rank, within one `timeout`.
    pub fn recv_frames_all(&mut self, timeout: Duration) -> Result<Vec<Vec<u8>>, RankError> {
        self.recv_frames_all_within(timeout, None)
    }

    /// [`recv_frames_all`](Self::recv_frames_all), and once one rank has
    /// answered, the others within `straggler`.
    pub fn recv_frames_all_within(
        &mut self,
        timeout: Duration,
        straggler: Option<Duration>,
    ) -> Result<Vec<Vec<u8>>, RankError> {
        self.wait_for(
            timeout,
            straggler,
            |p| p.iter().all(|q| !q.is_empty()),
            |p| p.iter().position(|q| q.is_empty()).unwrap_or(0),
        )?;
        Ok(self
            .pending
            .iter_mut()
            .map(|q| q.pop_front().unwrap())
            .collect())
    }

    /// One typed message from every rank, by rank, within one `timeout`.
    pub fn recv_all<T: DeserializeOwned>(
        &mut self,
        timeout: Duration,
    ) -> Result<Vec<T>, RankError> {
        self.recv_all_within(timeout, None)
    }

    /// One typed message from every rank, with a straggler deadline (see
    /// [`recv_frames_all_within`](Self::recv_frames_all_within)).
    pub fn recv_all_within<T: DeserializeOwned>(
        &mut self,
        timeout: Duration,
        straggler: Option<Duration>,
    ) -> Result<Vec<T>, RankError> {
        let frames = self.recv_frames_all_within(timeout, straggler)?;
        frames
            .iter()
            .enumerate()
            .map(|(rank, f)| self.decode(rank, f))
            .collect()
    }

    fn decode<T: DeserializeOwned>(&mut self, rank: usize, frame: &[u8]) -> Result<T, RankError> {
        channel::decode(frame).map_err(|e| {
            self.fail(RankError::Protocol {
                rank,
                reason: e.to_string(),
            })
        })
    }

    /// Stops every rank: closes the control channels (ranks exit on EOF),
    /// sends SIGTERM, SIGKILL after `grace`, and reaps them all. Returns each
    /// rank's exit status (`None` only if it could not be reaped).
    pub fn shutdown(&mut self, grace: Duration) -> Vec<Option<ExitStatus>> {
        if !self.shut_down {
            self.shut_down = true;
            self.shared.stopping.store(true, Ordering::SeqCst);
            for w in &self.writers {
                w.shutdown();
            }
            self.shared.terminate(grace);
            match self.watcher.take() {
                Some(h) => {
                    let _ = h.join();
                }
                None => {
                    // No watcher (start-up failed early): reap here.
                    let kill_at = Instant::now() + grace;
                    let mut killed = false;
                    while !self.shared.all_reaped() {
                        self.shared.poll();
                        if !killed && Instant::now() >= kill_at {
                            self.shared.signal_live(libc::SIGKILL);
                            killed = true;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            for h in self.readers.drain(..) {
                let _ = h.join();
            }
            // A helper the rank started may still hold its stderr open: don't
            // wait on it for long.
            for tail in &self.shared.tails {
                tail.wait_done(Duration::from_millis(200));
            }
            for h in std::mem::take(&mut self.stderr_threads) {
                if h.is_finished() {
                    let _ = h.join();
                }
            }
            if let Some((release, keeper)) = self.keeper.take() {
                drop(release);
                let _ = keeper.join();
            }
            tracing::debug!("TP rank group shut down");
        }
        lock(&self.shared.procs).iter().map(|p| p.exit).collect()
    }
}

impl Drop for RankGroup {
    fn drop(&mut self) {
        let grace = self.opts.grace;
        self.shutdown(grace);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::channel::RankChannel;
    use serde::Deserialize;
    use serde_json::json;

    /// The fake rank: this test binary, re-executed with `FAKE_RANK_MODE` set,
    /// runs only `fake_rank_entry`.
    const MODE_VAR: &str = "MLXCEL_TEST_FAKE_RANK_MODE";

    #[derive(Debug, Serialize, Deserialize)]
    enum Msg {
        Ping(u32),
        Pong { n: u32, rank: usize },
    }

    /// Where a fake driver writes its ranks' pids.
    const DRIVER_VAR: &str = "MLXCEL_TEST_FAKE_DRIVER_PIDS";

    #[test]
    fn fake_rank_entry() {
        let mode = std::env::var(MODE_VAR);
        if let (Err(_), Ok(path)) = (&mode, std::env::var(DRIVER_VAR)) {
            // A driver that gets SIGKILLed by the test: its ranks must die too.
            let g = start(&["ok", "stubborn"], &opts(), channel::identities_agree).unwrap();
            let pids: Vec<String> = g.pids().iter().map(u32::to_string).collect();
            std::fs::write(format!("{path}.tmp"), pids.join(" ")).unwrap();
            std::fs::rename(format!("{path}.tmp"), &path).unwrap();
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        let Ok(mode) = mode else {
            return; // Normal test run: nothing to do.
        };
        let rank: usize = std::env::var(CONTROL_RANK_VAR).unwrap().parse().unwrap();
        let mut identity = json!({"config_hash": "abc", "tp": 2});
        if mode == "mismatch" {
            identity["config_hash"] = json!("zzz");
        }
        if mode == "stubborn" {
            unsafe {
                libc::signal(libc::SIGTERM, libc::SIG_IGN);
            }
        }
        let conn = if mode == "badsecret" {
            let addr = std::env::var(CONTROL_ADDR_VAR).unwrap();
            RankChannel::connect(&addr, "0123456789abcdef0123456789abcdef", rank, identity)
        } else {
            RankChannel::connect_from_env(identity)
        };
        let mut ch = match conn {
            Ok(ch) => ch,
            Err(e) => {
                eprintln!("fake rank {rank}: handshake failed: {e}");
                std::process::exit(2);
            }
        };
        eprintln!("fake rank {rank}: connected ({mode})");
        if mode.starts_with("beat") {
            ch.start_heartbeat().unwrap();
        }
        loop {
            let msg = match ch.recv::<Msg>() {
                Ok(m) => m,
                Err(e) => {
                    if mode == "stubborn" {
                        loop {
                            std::thread::sleep(Duration::from_secs(1));
                        }
                    }
                    eprintln!("fake rank {rank}: channel closed ({e}), exiting");
                    std::process::exit(0);
                }
            };
            match (mode.as_str(), msg) {
                ("exit3", _) => {
                    eprintln!("fake rank {rank}: simulated NCCL failure, exiting with 3");
                    std::process::exit(3);
                }
                ("silent", _) | ("stubborn", _) | ("beat-silent", _) => {}
                // answers after 3 s (its heartbeat goes on meanwhile)
                ("beat-slow", Msg::Ping(n)) => {
                    std::thread::sleep(Duration::from_secs(3));
                    ch.send(&Msg::Pong { n, rank }).unwrap()
                }
                (_, Msg::Ping(n)) => ch.send(&Msg::Pong { n, rank }).unwrap(),
                (_, Msg::Pong { .. }) => unreachable!(),
            }
        }
    }

    fn opts() -> LaunchOptions {
        LaunchOptions {
            startup_timeout: Duration::from_secs(30),
            grace: Duration::from_millis(500),
            ..Default::default()
        }
    }

    fn start(
        modes: &[&str],
        opts: &LaunchOptions,
        check: impl FnOnce(&[serde_json::Value]) -> Result<(), IdentityMismatch>,
    ) -> Result<RankGroup, RankError> {
        let exe = std::env::current_exe().unwrap();
        let args = [
            "--exact",
            "parallel::launcher::tests::fake_rank_entry",
            "--nocapture",
            "--test-threads=1",
        ];
        let envs = modes
            .iter()
            .map(|m| vec![(MODE_VAR.to_string(), m.to_string())])
            .collect();
        RankGroup::spawn_with(exe.as_os_str(), &args, envs, opts, check)
    }

    fn alive(pid: u32) -> bool {
        std::path::Path::new(&format!("/proc/{pid}")).exists()
    }

    #[test]
    fn handshake_and_round_trips() {
        let mut seen = Vec::new();
        let mut g = start(&["ok", "ok"], &opts(), |ids| {
            seen = ids.to_vec();
            channel::identities_agree(ids)
        })
        .unwrap();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[1]["config_hash"], "abc");
        assert_eq!(g.world_size(), 2);
        for n in 0..3 {
            g.broadcast(&Msg::Ping(n)).unwrap();
            let replies: Vec<Msg> = g.recv_all(Duration::from_secs(10)).unwrap();
            for (r, m) in replies.iter().enumerate() {
                assert!(
                    matches!(m, Msg::Pong { n: k, rank } if *k == n && *rank == r),
                    "{m:?}"
                );
            }
        }
        g.send_to(1, &Msg::Ping(9)).unwrap();
        let m: Msg = g.recv_from(1, Duration::from_secs(10)).unwrap();
        assert!(matches!(m, Msg::Pong { n: 9, rank: 1 }));
        g.check_health().unwrap();
        let pids = g.pids();
        let statuses = g.shutdown(Duration::from_secs(2));
        // They exit 0 on EOF, before any SIGTERM matters (or die of SIGTERM).
        assert!(statuses.iter().all(Option::is_some));
        assert!(pids.iter().all(|p| !alive(*p)));
        assert!(matches!(g.check_health(), Err(RankError::ShutDown)));
    }

    #[test]
    fn wrong_secret_is_refused() {
        let t = Instant::now();
        let err = match start(&["ok", "badsecret"], &opts(), channel::identities_agree) {
            Ok(_) => panic!("a rank with a wrong secret was accepted"),
            Err(e) => e,
        };
        match &err {
            RankError::Died {
                rank: 1,
                status,
                stderr_tail,
            } => {
                assert_eq!(status.code(), Some(2));
                assert!(
                    stderr_tail
                        .iter()
                        .any(|l| l.contains("rejected this rank: wrong secret")),
                    "{stderr_tail:?}"
                );
            }
            e => panic!("unexpected error: {e}"),
        }
        assert!(t.elapsed() < Duration::from_secs(20));
    }

    #[test]
    fn identity_mismatch_names_the_rank() {
        let err = match start(&["ok", "mismatch"], &opts(), channel::identities_agree) {
            Ok(_) => panic!("mismatched identities were accepted"),
            Err(e) => e,
        };
        assert!(
            matches!(&err, RankError::IdentityMismatch { rank: 1, what } if what.contains("/config_hash")),
            "{err}"
        );
        assert!(err.to_string().contains("\"zzz\""), "{err}");
    }

    #[test]
    fn dead_rank_is_reported_promptly_and_the_rest_are_stopped() {
        let mut g = start(&["ok", "exit3"], &opts(), channel::identities_agree).unwrap();
        let pids = g.pids();
        let t = Instant::now();
        g.broadcast(&Msg::Ping(1)).unwrap();
        let err = g.recv_all::<Msg>(Duration::from_secs(30)).unwrap_err();
        let took = t.elapsed();
        match &err {
            RankError::Died {
                rank: 1,
                status,
                stderr_tail,
            } => {
                assert_eq!(status.code(), Some(3));
                assert!(
                    stderr_tail
                        .last()
                        .unwrap()
                        .contains("simulated NCCL failure"),
                    "{stderr_tail:?}"
                );
            }
            e => panic!("unexpected error: {e}"),
        }
        assert!(took < Duration::from_secs(1), "took {took:?}");
        assert!(err.to_string().contains("simulated NCCL failure"));
        // Every later call reports the same failure.
        assert!(matches!(
            g.send_to(0, &Msg::Ping(2)),
            Err(RankError::Died { rank: 1, .. })
        ));
        // Rank 0 is stopped without anyone calling shutdown.
        let until = Instant::now() + Duration::from_secs(5);
        while alive(pids[0]) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            !alive(pids[0]),
            "rank 0 still running 5 s after the failure"
        );
    }

    #[test]
    fn silent_rank_times_out() {
        let mut g = start(&["silent"], &opts(), channel::identities_agree).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        while g.stderr_tail(0).is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        g.send_to(0, &Msg::Ping(1)).unwrap();
        let t = Instant::now();
        let err = g
            .recv_from::<Msg>(0, Duration::from_millis(300))
            .unwrap_err();
        let took = t.elapsed();
        assert!(
            matches!(&err, RankError::Timeout { rank: 0, after, stderr_tail }
                if *after == Duration::from_millis(300)
                    && stderr_tail.iter().any(|l| l.contains("connected (silent)"))),
            "{err}"
        );
        assert!(
            took >= Duration::from_millis(290) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }

    fn beating() -> LaunchOptions {
        LaunchOptions {
            heartbeat_timeout: Some(Duration::from_millis(1500)),
            ..opts()
        }
    }

    #[test]
    fn heartbeats_keep_a_busy_rank_and_find_a_stopped_one() {
        // a rank that answers nothing for 3 s but heartbeats is no failure
        let mut g = start(
            &["beat", "beat-slow"],
            &beating(),
            channel::identities_agree,
        )
        .unwrap();
        g.broadcast(&Msg::Ping(1)).unwrap();
        let r: Vec<Msg> = g.recv_all(Duration::from_secs(20)).unwrap();
        assert_eq!(r.len(), 2);
        // SIGSTOP of rank 1 while idle: the group fails naming it, within the timeout + a bit
        let pid = g.pids()[1];
        unsafe {
            libc::kill(pid as i32, libc::SIGSTOP);
        }
        let t = Instant::now();
        let err = loop {
            if let Err(e) = g.check_health() {
                break e;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no failure");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            matches!(&err, RankError::HeartbeatLost { rank: 1, silent, .. }
                if *silent > Duration::from_millis(1500)),
            "{err}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(
            err.to_string().contains("TP rank 1 sent no heartbeat"),
            "{err}"
        );
        // a stopped rank dies by SIGKILL after the grace period
        g.shutdown(Duration::from_millis(300));
        assert!(!alive(pid), "the stopped rank was left behind");
    }

    #[test]
    fn a_straggler_is_blamed_once_another_rank_has_answered() {
        let mut g = start(
            &["beat", "beat-silent"],
            &beating(),
            channel::identities_agree,
        )
        .unwrap();
        g.broadcast(&Msg::Ping(1)).unwrap();
        let t = Instant::now();
        let err = g
            .recv_all_within::<Msg>(Duration::from_secs(30), Some(Duration::from_millis(700)))
            .unwrap_err();
        assert!(
            matches!(
                &err,
                RankError::Straggler {
                    rank: 1,
                    first: 0,
                    ..
                }
            ),
            "{err}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // with no answer at all, the straggler deadline does not apply
        let mut g = start(
            &["beat-silent", "beat-silent"],
            &beating(),
            channel::identities_agree,
        )
        .unwrap();
        g.broadcast(&Msg::Ping(1)).unwrap();
        let err = g
            .recv_all_within::<Msg>(
                Duration::from_millis(1200),
                Some(Duration::from_millis(100)),
            )
            .unwrap_err();
        assert!(matches!(&err, RankError::Timeout { .. }), "{err}");
    }

    #[test]
    fn a_stopped_rank_that_answered_is_blamed_not_the_one_waiting_for_it() {
        // rank 1 answers, then stops; rank 0 (heartbeating) is late: the straggler deadline
        // comes before the heartbeat timeout and must still name the silent rank 1
        let opts = LaunchOptions {
            heartbeat_timeout: Some(Duration::from_secs(10)),
            ..opts()
        };
        let mut g = start(&["beat-silent", "beat"], &opts, channel::identities_agree).unwrap();
        g.broadcast(&Msg::Ping(1)).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let pid = g.pids()[1];
        unsafe {
            libc::kill(pid as i32, libc::SIGSTOP);
        }
        let t = Instant::now();
        let err = g
            .recv_all_within::<Msg>(Duration::from_secs(30), Some(Duration::from_secs(3)))
            .unwrap_err();
        assert!(
            matches!(&err, RankError::HeartbeatLost { rank: 1, .. }),
            "{err}"
        );
        assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
        g.shutdown(Duration::from_millis(300));
        assert!(!alive(pid), "the stopped rank was left behind");
    }

    #[test]
    fn shutdown_kills_a_rank_that_ignores_sigterm() {
        let mut g = start(&["stubborn", "ok"], &opts(), channel::identities_agree).unwrap();
        let pids = g.pids();
        let grace = Duration::from_millis(500);
        let t = Instant::now();
        let statuses = g.shutdown(grace);
        let took = t.elapsed();
        assert!(took < grace + Duration::from_secs(1), "took {took:?}");
        assert!(
            took >= grace,
            "SIGKILL came before the grace period ended: {took:?}"
        );
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(statuses[0].unwrap().signal(), Some(libc::SIGKILL));
        assert!(pids.iter().all(|p| !alive(*p)));
    }

    #[test]
    fn drop_leaves_no_process_behind() {
        let g = start(
            &["ok", "stubborn", "silent"],
            &opts(),
            channel::identities_agree,
        )
        .unwrap();
        let pids = g.pids();
        assert!(pids.iter().all(|p| alive(*p)));
        drop(g);
        for p in pids {
            assert!(!alive(p), "pid {p} is still there");
        }
    }

    #[test]
    fn startup_timeout_when_a_rank_never_connects() {
        // `sleep` never connects; `true` exits at once (a failure too).
        let o = LaunchOptions {
            startup_timeout: Duration::from_millis(400),
            grace: Duration::from_millis(200),
            ..Default::default()
        };
        let t = Instant::now();
        let err =
            match RankGroup::spawn_with(OsStr::new("sleep"), &["30"], vec![vec![]], &o, |_| Ok(()))
            {
                Ok(_) => panic!("a rank that never connected was accepted"),
                Err(e) => e,
            };
        assert!(
            matches!(
                err,
                RankError::StartupTimeout {
                    rank: 0,
                    rejected: 0,
                    ..
                }
            ),
            "{err}"
        );
        assert!(t.elapsed() < Duration::from_secs(3));

        let err = match RankGroup::spawn_with(
            OsStr::new("/nonexistent/mlxcel"),
            &["x"],
            vec![vec![]],
            &o,
            |_| Ok(()),
        ) {
            Ok(_) => panic!("spawned a missing program"),
            Err(e) => e,
        };
        assert!(matches!(err, RankError::Spawn { rank: 0, .. }), "{err}");
    }

    #[test]
    fn ranks_die_with_the_driver() {
        let tmp = tempfile::Builder::new()
            .prefix("mlxcel-fake-driver-")
            .tempdir()
            .unwrap();
        let path = tmp.path().join("pids");
        struct Reap(Child);
        impl Drop for Reap {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut driver = Reap(
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "parallel::launcher::tests::fake_rank_entry",
                    "--nocapture",
                ])
                .env(DRIVER_VAR, &path)
                .env_remove(MODE_VAR)
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let until = Instant::now() + Duration::from_secs(30);
        while !path.exists() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        let pids: Vec<u32> = std::fs::read_to_string(&path)
            .expect("the fake driver did not start its ranks")
            .split(' ')
            .map(|p| p.parse().unwrap())
            .collect();
        let _ = std::fs::remove_file(&path);
        assert_eq!(pids.len(), 2);
        assert!(pids.iter().all(|p| alive(*p)));
        driver.0.kill().unwrap();
        driver.0.wait().unwrap();
        // The ranks are re-parented and reaped by init (or a subreaper) once
        // killed; "stubborn" ignores SIGTERM and EOF, so only the death
        // signal can have killed it.
        let until = Instant::now() + Duration::from_secs(3);
        let gone = |p: &u32| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .map(|s| s.contains(") Z "))
                .unwrap_or(true)
        };
        while !pids.iter().all(gone) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            pids.iter().all(gone),
            "ranks outlived their driver: {pids:?}"
        );
    }

    #[test]
    fn free_ports_are_distinct() {
        let ports = pick_free_ports(4).unwrap();
        assert_eq!(ports.len(), 4);
        let mut sorted = ports.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 4);
        assert!(ports.iter().all(|p| *p != 0));
    }

    #[test]
    fn ansi_is_stripped() {
        assert_eq!(
            strip_ansi("\u{1b}[2m2025\u{1b}[0m \u{1b}[31mERROR\u{1b}[0m x"),
            "2025 ERROR x"
        );
    }
}
