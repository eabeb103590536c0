//! The control channel between the driver and its TP ranks.
//!
//! Framing and encoding are separate layers:
//! - **framing**: a frame is a `u32` little-endian byte length followed by that
//!   many bytes, at most [`MAX_FRAME_BYTES`] (checked on both ends);
//! - **codec**: typed messages are JSON ([`encode`] / [`decode`]); bulk
//!   numbers (logits) can travel as raw little-endian `f32` frames
//!   ([`encode_f32s`] / [`decode_f32s`]), with the protocol saying which frame
//!   is which.
//!
//! Start-up handshake: the driver listens on `127.0.0.1:0`, and gives every rank
//! [`CONTROL_ADDR_VAR`], [`CONTROL_SECRET_VAR`] (128 random bits, hex) and
//! [`CONTROL_RANK_VAR`]. The rank connects and sends a [`Hello`]; the driver
//! checks the secret, that every rank connects exactly once and that the ranks'
//! identities agree, then answers each one with a [`HelloReply`].
//!
//! The rank side is [`RankChannel::connect_from_env`]. **A rank's receive loop
//! must treat [`ChannelError::Closed`] (and any other receive error) as "exit
//! now"**: the driver closes the channel, or dies, when the group is stopped.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Largest frame either end sends or accepts.
pub const MAX_FRAME_BYTES: usize = 256 << 20;

/// How often a rank sends a heartbeat (an empty frame) once connected.
pub const HEARTBEAT_PERIOD: Duration = Duration::from_millis(500);

/// Environment variables the driver sets for every rank.
pub const CONTROL_ADDR_VAR: &str = "MLXCEL_CONTROL_ADDR";
pub const CONTROL_SECRET_VAR: &str = "MLXCEL_CONTROL_SECRET";
pub const CONTROL_RANK_VAR: &str = "MLXCEL_CONTROL_RANK";

/// A control channel failure.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("control channel closed by the peer")]
    Closed,
    #[error(
        "control channel closed in the middle of a frame ({got} of {expected} bytes): \
         the peer crashed or was killed"
    )]
    Truncated { got: usize, expected: usize },
    #[error(
        "control frame of {len} bytes exceeds the {max}-byte limit: split the payload into \
         several frames"
    )]
    TooLarge { len: usize, max: usize },
    #[error("no control frame within {0:?}")]
    Timeout(Duration),
    #[error("control channel I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("control message could not be encoded or decoded: {0}")]
    Codec(#[from] serde_json::Error),
    #[error("bad f32 frame: {len} bytes is not a multiple of 4")]
    BadF32Frame { len: usize },
    #[error(
        "{var} is not set: this process is meant to be started by the mlxcel driver as a TP rank"
    )]
    MissingEnv { var: &'static str },
    #[error("{var}={value:?} is invalid: {reason}")]
    BadEnv {
        var: &'static str,
        value: String,
        reason: String,
    },
    #[error("could not connect to the mlxcel driver at {addr}: {source} (did the driver exit?)")]
    Connect { addr: String, source: io::Error },
    #[error("the driver rejected this rank: {reason}")]
    Rejected { reason: String },
}

impl ChannelError {
    /// Whether the peer is gone (clean close, or close mid-frame).
    pub fn is_closed(&self) -> bool {
        match self {
            ChannelError::Closed | ChannelError::Truncated { .. } => true,
            ChannelError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::UnexpectedEof
            ),
            _ => false,
        }
    }
}

// ---------------------------------------------------------------- codec

/// Encodes a typed message as a frame body (JSON).
pub fn encode<T: Serialize + ?Sized>(msg: &T) -> Result<Vec<u8>, ChannelError> {
    Ok(serde_json::to_vec(msg)?)
}

/// Decodes a frame body produced by [`encode`].
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, ChannelError> {
    Ok(serde_json::from_slice(body)?)
}

/// Encodes `f32`s as a raw little-endian frame body (4 bytes each).
pub fn encode_f32s(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Decodes a frame body produced by [`encode_f32s`].
pub fn decode_f32s(body: &[u8]) -> Result<Vec<f32>, ChannelError> {
    if !body.len().is_multiple_of(4) {
        return Err(ChannelError::BadF32Frame { len: body.len() });
    }
    Ok(body
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

// ---------------------------------------------------------------- framing

/// One end of a framed control connection.
///
/// Receiving keeps partial frames in an internal buffer, so a
/// [`recv_timeout`](Channel::recv_timeout) that expires mid-frame leaves the
/// stream in sync and a later receive completes the frame.
pub struct Channel {
    stream: TcpStream,
    rbuf: Vec<u8>,
    max_frame: usize,
    /// The read timeout currently set on the socket (avoids a syscall per read).
    read_timeout: Option<Duration>,
    /// Held while a frame is written, once a heartbeat thread writes too.
    write_lock: Option<Arc<Mutex<()>>>,
}

impl Channel {
    /// Wraps a connected stream (sets `TCP_NODELAY`: control messages are small
    /// and latency-bound).
    pub fn new(stream: TcpStream) -> Result<Self, ChannelError> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(None)?;
        Ok(Self {
            stream,
            rbuf: Vec::new(),
            max_frame: MAX_FRAME_BYTES,
            read_timeout: None,
            write_lock: None,
        })
    }

    /// Connects to `addr` (no retry).
    pub fn connect(addr: &str) -> Result<Self, ChannelError> {
        let stream = TcpStream::connect(addr).map_err(|source| ChannelError::Connect {
            addr: addr.to_string(),
            source,
        })?;
        Self::new(stream)
    }

    /// Changes the frame size limit (both directions) from [`MAX_FRAME_BYTES`].
    pub fn set_max_frame(&mut self, max: usize) {
        self.max_frame = max.min(u32::MAX as usize);
    }

    /// Bounds how long a send may block on a peer that does not read.
    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> Result<(), ChannelError> {
        Ok(self.stream.set_write_timeout(timeout)?)
    }

    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.stream.peer_addr().ok()
    }

    /// A second handle on the same connection for a reader thread; partial
    /// input already buffered here moves to the new handle.
    pub fn split_reader(&mut self) -> Result<Channel, ChannelError> {
        let stream = self.stream.try_clone()?;
        Ok(Channel {
            stream,
            rbuf: std::mem::take(&mut self.rbuf),
            max_frame: self.max_frame,
            read_timeout: self.read_timeout,
            write_lock: self.write_lock.clone(),
        })
    }

    /// Sends an empty frame every `period` from a thread of its own until the
    /// connection breaks. The thread only writes to the socket (it touches no
    /// other state), so the peer hears it while this side is busy for long,
    /// and stops hearing it when this process is stopped or frozen. Frames
    /// sent on this channel are written under a lock from then on, so the
    /// two writers never interleave.
    pub fn start_heartbeat(&mut self, period: Duration) -> Result<(), ChannelError> {
        let mut stream = self.stream.try_clone()?;
        let lock = self
            .write_lock
            .get_or_insert_with(|| Arc::new(Mutex::new(())))
            .clone();
        std::thread::Builder::new()
            .name("mlxcel-heartbeat".into())
            .spawn(move || loop {
                std::thread::sleep(period);
                let _held = lock.lock().unwrap_or_else(|e| e.into_inner());
                if stream.write_all(&0u32.to_le_bytes()).is_err() {
                    return;
                }
            })?;
        Ok(())
    }

    /// Shuts the connection down both ways: the peer sees EOF, and a thread
    /// blocked receiving on any handle of this connection wakes up.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Sends one frame.
    pub fn send_frame(&mut self, body: &[u8]) -> Result<(), ChannelError> {
        if body.len() > self.max_frame {
            return Err(ChannelError::TooLarge {
                len: body.len(),
                max: self.max_frame,
            });
        }
        let header = (body.len() as u32).to_le_bytes();
        let lock = self.write_lock.clone();
        let _held = lock
            .as_ref()
            .map(|l| l.lock().unwrap_or_else(|e| e.into_inner()));
        if body.len() <= 64 * 1024 {
            let mut buf = Vec::with_capacity(4 + body.len());
            buf.extend_from_slice(&header);
            buf.extend_from_slice(body);
            self.stream.write_all(&buf)?;
        } else {
            self.stream.write_all(&header)?;
            self.stream.write_all(body)?;
        }
        Ok(())
    }

    /// Receives one frame, blocking until it arrives or the peer closes.
    pub fn recv_frame(&mut self) -> Result<Vec<u8>, ChannelError> {
        self.recv_frame_until(None)
    }

    /// Receives one frame, or [`ChannelError::Timeout`] after `timeout`.
    pub fn recv_frame_timeout(&mut self, timeout: Duration) -> Result<Vec<u8>, ChannelError> {
        self.recv_frame_until(Some(Instant::now() + timeout))
            .map_err(|e| match e {
                ChannelError::Timeout(_) => ChannelError::Timeout(timeout),
                e => e,
            })
    }

    fn set_read_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        if self.read_timeout != timeout {
            self.stream.set_read_timeout(timeout)?;
            self.read_timeout = timeout;
        }
        Ok(())
    }

    fn recv_frame_until(&mut self, deadline: Option<Instant>) -> Result<Vec<u8>, ChannelError> {
        loop {
            // A whole frame buffered?
            let mut want = 4;
            if self.rbuf.len() >= 4 {
                let len =
                    u32::from_le_bytes([self.rbuf[0], self.rbuf[1], self.rbuf[2], self.rbuf[3]])
                        as usize;
                if len > self.max_frame {
                    return Err(ChannelError::TooLarge {
                        len,
                        max: self.max_frame,
                    });
                }
                want = 4 + len;
                if self.rbuf.len() >= want {
                    let body = self.rbuf[4..want].to_vec();
                    self.rbuf.drain(..want);
                    return Ok(body);
                }
            }
            // Read more, at most up to the end of the current frame (large
            // frames are read straight into place).
            let timeout = match deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ChannelError::Timeout(Duration::ZERO));
                    }
                    Some(left)
                }
            };
            self.set_read_timeout(timeout)?;
            let start = self.rbuf.len();
            let chunk = (want - start).max(64 * 1024);
            self.rbuf.resize(start + chunk, 0);
            let got = self.stream.read(&mut self.rbuf[start..]);
            match got {
                Ok(0) => {
                    self.rbuf.truncate(start);
                    if start == 0 {
                        return Err(ChannelError::Closed);
                    }
                    return Err(ChannelError::Truncated {
                        got: start,
                        expected: want,
                    });
                }
                Ok(n) => self.rbuf.truncate(start + n),
                Err(e) => {
                    self.rbuf.truncate(start);
                    match e.kind() {
                        io::ErrorKind::Interrupted => {}
                        // Deadline checked at the top of the loop.
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {}
                        _ => return Err(e.into()),
                    }
                }
            }
        }
    }

    /// Sends a typed message.
    pub fn send<T: Serialize + ?Sized>(&mut self, msg: &T) -> Result<(), ChannelError> {
        let body = encode(msg)?;
        self.send_frame(&body)
    }

    /// Receives a typed message (blocks).
    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<T, ChannelError> {
        decode(&self.recv_frame()?)
    }

    /// Receives a typed message, or [`ChannelError::Timeout`] after `timeout`.
    pub fn recv_timeout<T: DeserializeOwned>(
        &mut self,
        timeout: Duration,
    ) -> Result<T, ChannelError> {
        decode(&self.recv_frame_timeout(timeout)?)
    }

    /// Sends `f32`s as one raw frame.
    pub fn send_f32s(&mut self, values: &[f32]) -> Result<(), ChannelError> {
        self.send_frame(&encode_f32s(values))
    }

    /// Receives one raw `f32` frame.
    pub fn recv_f32s(&mut self) -> Result<Vec<f32>, ChannelError> {
        decode_f32s(&self.recv_frame()?)
    }
}

// ---------------------------------------------------------------- handshake

/// The first message a rank sends.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    pub rank: usize,
    pub secret: String,
    /// What the ranks must agree on (config hash, TP size, weight file
    /// sizes…); opaque to the channel, checked by the driver's closure.
    pub identity: serde_json::Value,
}

/// The driver's answer to a [`Hello`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum HelloReply {
    Accepted { world_size: usize },
    Rejected { reason: String },
}

/// A fresh 128-bit secret as 32 hex digits (from `/dev/urandom`, else the
/// thread-local CSPRNG).
pub fn new_secret() -> String {
    let mut bytes = [0u8; 16];
    let from_os = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .is_ok();
    if !from_os {
        bytes = rand::random();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compares two secrets in time independent of where they differ.
pub fn secrets_match(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Why one rank's identity is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityMismatch {
    pub rank: usize,
    /// What differed, e.g. `/config_hash: "ab12" (rank 0) vs "cd34"`.
    pub what: String,
}

/// The default identity check: every rank's identity equals rank 0's.
pub fn identities_agree(identities: &[serde_json::Value]) -> Result<(), IdentityMismatch> {
    let Some(first) = identities.first() else {
        return Ok(());
    };
    for (rank, id) in identities.iter().enumerate().skip(1) {
        if let Some(what) = first_difference(first, id) {
            return Err(IdentityMismatch { rank, what });
        }
    }
    Ok(())
}

/// The first place where `b` differs from the reference `a`, as a JSON
/// pointer and the two values; `None` if equal.
pub fn first_difference(a: &serde_json::Value, b: &serde_json::Value) -> Option<String> {
    fn walk(a: &serde_json::Value, b: &serde_json::Value, path: &mut String) -> Option<String> {
        use serde_json::Value;
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                for (k, va) in x {
                    let len = path.len();
                    path.push('/');
                    path.push_str(k);
                    let r = match y.get(k) {
                        Some(vb) => walk(va, vb, path),
                        None => Some(format!("{path}: {va} (rank 0) vs missing")),
                    };
                    path.truncate(len);
                    if r.is_some() {
                        return r;
                    }
                }
                y.iter()
                    .find(|(k, _)| !x.contains_key(*k))
                    .map(|(k, vb)| format!("{path}/{k}: missing (rank 0) vs {vb}"))
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                    let len = path.len();
                    path.push_str(&format!("/{i}"));
                    let r = walk(va, vb, path);
                    path.truncate(len);
                    if r.is_some() {
                        return r;
                    }
                }
                None
            }
            _ if a == b => None,
            _ => {
                let p = if path.is_empty() { "/" } else { path.as_str() };
                Some(format!("{p}: {a} (rank 0) vs {b}"))
            }
        }
    }
    walk(a, b, &mut String::new())
}

/// The rank end of the control channel, after a successful handshake.
pub struct RankChannel {
    channel: Channel,
    rank: usize,
    world_size: usize,
}

impl RankChannel {
    /// Connects to the driver named by [`CONTROL_ADDR_VAR`],
    /// [`CONTROL_SECRET_VAR`] and [`CONTROL_RANK_VAR`], sends the [`Hello`]
    /// and waits for the driver's verdict (which comes once every rank has
    /// connected and the identities were checked).
    ///
    /// Afterwards the rank's receive loop must exit the process on any
    /// receive error, [`ChannelError::Closed`] above all: that is how the
    /// driver stops a rank it cannot signal, and how a rank outlives neither
    /// the driver nor the group.
    pub fn connect_from_env(identity: serde_json::Value) -> Result<Self, ChannelError> {
        fn var(name: &'static str) -> Result<String, ChannelError> {
            std::env::var(name).map_err(|_| ChannelError::MissingEnv { var: name })
        }
        let addr = var(CONTROL_ADDR_VAR)?;
        let secret = var(CONTROL_SECRET_VAR)?;
        let rank_s = var(CONTROL_RANK_VAR)?;
        let rank = rank_s.trim().parse().map_err(|e| ChannelError::BadEnv {
            var: CONTROL_RANK_VAR,
            value: rank_s.clone(),
            reason: format!("{e}"),
        })?;
        Self::connect(&addr, &secret, rank, identity)
    }

    /// [`connect_from_env`](Self::connect_from_env) with explicit values.
    pub fn connect(
        addr: &str,
        secret: &str,
        rank: usize,
        identity: serde_json::Value,
    ) -> Result<Self, ChannelError> {
        let mut channel = Channel::connect(addr)?;
        channel.send(&Hello {
            rank,
            secret: secret.to_string(),
            identity,
        })?;
        match channel.recv::<HelloReply>()? {
            HelloReply::Accepted { world_size } => {
                tracing::debug!(rank, world_size, "control channel connected to {addr}");
                Ok(Self {
                    channel,
                    rank,
                    world_size,
                })
            }
            HelloReply::Rejected { reason } => Err(ChannelError::Rejected { reason }),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Heartbeats to the driver every [`HEARTBEAT_PERIOD`] (see [`Channel::start_heartbeat`]).
    pub fn start_heartbeat(&mut self) -> Result<(), ChannelError> {
        self.channel.start_heartbeat(HEARTBEAT_PERIOD)
    }

    /// The underlying channel (send/recv, raw frames, `f32` frames).
    pub fn channel(&mut self) -> &mut Channel {
        &mut self.channel
    }

    pub fn send<T: Serialize + ?Sized>(&mut self, msg: &T) -> Result<(), ChannelError> {
        self.channel.send(msg)
    }

    /// Receives the next message; on any error (EOF above all) exit now.
    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<T, ChannelError> {
        self.channel.recv()
    }

    pub fn recv_timeout<T: DeserializeOwned>(
        &mut self,
        timeout: Duration,
    ) -> Result<T, ChannelError> {
        self.channel.recv_timeout(timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (Channel, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let c = Channel::connect(&addr).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Msg {
        a: u32,
        b: String,
    }

    #[test]
    fn typed_and_f32_frames_round_trip() {
        let (mut a, s) = pair();
        let mut b = Channel::new(s).unwrap();
        a.send(&Msg {
            a: 7,
            b: "x".into(),
        })
        .unwrap();
        let big: Vec<f32> = (0..300_000).map(|i| i as f32 * 0.5 - 3.0).collect();
        a.send_f32s(&big).unwrap();
        a.send_frame(&[]).unwrap();
        assert_eq!(
            b.recv::<Msg>().unwrap(),
            Msg {
                a: 7,
                b: "x".into()
            }
        );
        assert_eq!(b.recv_f32s().unwrap(), big);
        assert_eq!(b.recv_frame().unwrap(), Vec::<u8>::new());
        drop(a);
        assert!(matches!(b.recv_frame(), Err(ChannelError::Closed)));
    }

    #[test]
    fn timeout_mid_frame_keeps_the_stream_in_sync() {
        let (mut a, mut raw) = pair();
        let body = encode(&Msg {
            a: 1,
            b: "hello".into(),
        })
        .unwrap();
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        raw.write_all(&frame[..6]).unwrap();
        let t = Instant::now();
        let err = a
            .recv_timeout::<Msg>(Duration::from_millis(100))
            .unwrap_err();
        assert!(matches!(err, ChannelError::Timeout(d) if d == Duration::from_millis(100)));
        assert!(t.elapsed() < Duration::from_secs(2));
        raw.write_all(&frame[6..]).unwrap();
        raw.write_all(&frame).unwrap();
        assert_eq!(a.recv::<Msg>().unwrap().b, "hello");
        assert_eq!(a.recv_timeout::<Msg>(Duration::from_secs(5)).unwrap().a, 1);
    }

    #[test]
    fn oversized_and_truncated_frames_are_errors() {
        let (mut a, mut raw) = pair();
        a.set_max_frame(16);
        assert!(matches!(
            a.send_frame(&[0u8; 17]),
            Err(ChannelError::TooLarge { len: 17, max: 16 })
        ));
        raw.write_all(&100u32.to_le_bytes()).unwrap();
        assert!(matches!(
            a.recv_frame(),
            Err(ChannelError::TooLarge { len: 100, max: 16 })
        ));

        let (mut a, mut raw) = pair();
        raw.write_all(&10u32.to_le_bytes()).unwrap();
        raw.write_all(b"abc").unwrap();
        drop(raw);
        let err = a.recv_frame().unwrap_err();
        assert!(
            matches!(
                err,
                ChannelError::Truncated {
                    got: 7,
                    expected: 14
                }
            ),
            "{err}"
        );
        assert!(err.is_closed());
    }

    #[test]
    fn bad_f32_frame_is_an_error() {
        assert!(matches!(
            decode_f32s(&[0; 5]),
            Err(ChannelError::BadF32Frame { len: 5 })
        ));
        assert_eq!(
            decode_f32s(&encode_f32s(&[1.5, -2.0])).unwrap(),
            vec![1.5, -2.0]
        );
    }

    #[test]
    fn secrets() {
        let s = new_secret();
        assert_eq!(s.len(), 32);
        assert!(s.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(s, new_secret());
        assert!(secrets_match(&s, &s.clone()));
        assert!(!secrets_match(&s, &new_secret()));
        assert!(!secrets_match(&s, &s[..31]));
    }

    #[test]
    fn identity_differences_name_the_rank_and_path() {
        use serde_json::json;
        let a = json!({"config_hash": "ab", "tp": 2, "files": {"m.safetensors": 10}});
        let b = json!({"config_hash": "ab", "tp": 2, "files": {"m.safetensors": 11}});
        assert_eq!(identities_agree(&[a.clone(), a.clone()]), Ok(()));
        let err = identities_agree(&[a.clone(), a.clone(), b]).unwrap_err();
        assert_eq!(err.rank, 2);
        assert_eq!(err.what, "/files/m.safetensors: 10 (rank 0) vs 11");
        let c = json!({"config_hash": "ab", "tp": 2, "files": {}, "extra": 1});
        let what = first_difference(&a, &c).unwrap();
        assert!(
            what.starts_with("/files/m.safetensors: 10 (rank 0) vs missing"),
            "{what}"
        );
        assert_eq!(
            first_difference(&json!(1), &json!(2)).unwrap(),
            "/: 1 (rank 0) vs 2"
        );
    }
}
