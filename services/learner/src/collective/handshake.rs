//! The learner ranks' handshake: rank 0 sends a random challenge; the
//! joining rank answers with its number, its own nonce and an HMAC-SHA256
//! (keyed by the mesh secret) over the challenge, the number and the nonce;
//! rank 0 answers with an HMAC of the joiner's nonce. Each side so proves it
//! holds the secret, and a MAC of one message never passes for another.

use std::io::{BufReader, BufWriter};
use std::net::TcpStream;
use std::time::Duration;

use super::{Link, read_frame, write_frame};

/// Bytes of a handshake frame at most (a rank number, a nonce and a MAC).
pub(super) const HANDSHAKE_FRAME: usize = 1024;
/// Labels that keep a MAC of one handshake message from passing for another.
const HELLO: &[u8] = b"sleuth learner rank hello v1";
const WELCOME: &[u8] = b"sleuth learner rank welcome v1";

type Hmac = hmac::Hmac<sha2::Sha256>;

/// An HMAC-SHA256 under the mesh secret, fed `parts`.
fn keyed(key: &[u8], parts: &[&[u8]]) -> Hmac {
    use hmac::Mac as _;
    let mut mac = Hmac::new_from_slice(key).expect("HMAC takes keys of any length");
    for part in parts {
        mac.update(part);
    }
    mac
}

/// HMAC-SHA256 of `parts` under the mesh secret.
fn mac(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    use hmac::Mac as _;
    keyed(key, parts).finalize().into_bytes().to_vec()
}

/// Whether `presented` is the MAC of `parts`, in constant time.
fn verify(key: &[u8], parts: &[&[u8]], presented: &[u8]) -> bool {
    use hmac::Mac as _;
    keyed(key, parts).verify_slice(presented).is_ok()
}

fn nonce() -> Result<[u8; 32], String> {
    let mut nonce = [0u8; 32];
    getrandom::fill(&mut nonce).map_err(|e| format!("no randomness for a nonce: {e}"))?;
    Ok(nonce)
}

/// Sets a connection up for a link: no Nagle delay, TCP keepalive (a peer
/// whose host died is noticed), reads and writes bounded by `timeout`.
fn link(stream: TcpStream, timeout: Duration) -> std::io::Result<Link> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    let keepalive =
        socket2::TcpKeepalive::new().with_time(Duration::from_secs(30)).with_interval(Duration::from_secs(10));
    socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let reader = stream.try_clone()?;
    Ok((BufReader::new(reader), BufWriter::new(stream)))
}

/// A link past its handshake: reads and writes bounded by `timeout` from now on.
pub(super) fn settle(link: Link, timeout: Duration) -> std::io::Result<Link> {
    link.0.get_ref().set_read_timeout(Some(timeout))?;
    link.1.get_ref().set_write_timeout(Some(timeout))?;
    Ok(link)
}

/// Rank 0's side of the handshake: challenge, check the hello's MAC (over the
/// challenge, the rank and the joiner's nonce), answer with a MAC of the
/// joiner's nonce. Returns the rank admitted.
pub(super) fn admit(
    stream: TcpStream,
    secret: &[u8],
    timeout: Duration,
    world: usize,
) -> Result<(usize, Link), String> {
    let (mut reader, mut writer) = link(stream, timeout).map_err(|e| e.to_string())?;
    let challenge = nonce()?;
    write_frame(&mut writer, &challenge).map_err(|e| format!("sending the challenge: {e}"))?;
    let hello = read_frame(&mut reader, HANDSHAKE_FRAME).map_err(|e| format!("reading the hello: {e}"))?;
    if hello.len() != 8 + 32 + 32 {
        return Err(format!("a hello of {} bytes", hello.len()));
    }
    let (rank_bytes, rest) = hello.split_at(8);
    let (their_nonce, presented) = rest.split_at(32);
    if !verify(secret, &[HELLO, &challenge, rank_bytes, their_nonce], presented) {
        return Err("the hello's MAC does not match the mesh secret".into());
    }
    let rank = u64::from_le_bytes(rank_bytes.try_into().expect("8 bytes"));
    if rank == 0 || rank >= world as u64 {
        return Err(format!("rank {rank} is outside 1..WORLD_SIZE {world}"));
    }
    write_frame(&mut writer, &mac(secret, &[WELCOME, their_nonce, rank_bytes]))
        .map_err(|e| format!("sending the welcome: {e}"))?;
    Ok((rank as usize, (reader, writer)))
}

/// A joining rank's side of the handshake; rank 0 must prove it holds the
/// secret too, so a rank never takes commands from an impostor.
pub(super) fn join(stream: TcpStream, secret: &[u8], timeout: Duration, rank: usize) -> Result<Link, String> {
    let (mut reader, mut writer) = link(stream, timeout).map_err(|e| e.to_string())?;
    let challenge = read_frame(&mut reader, HANDSHAKE_FRAME).map_err(|e| format!("reading the challenge: {e}"))?;
    let ours = nonce()?;
    let rank_bytes = (rank as u64).to_le_bytes();
    let hello = [&rank_bytes[..], &ours, &mac(secret, &[HELLO, &challenge, &rank_bytes, &ours])].concat();
    write_frame(&mut writer, &hello).map_err(|e| format!("sending the hello: {e}"))?;
    let welcome = read_frame(&mut reader, HANDSHAKE_FRAME)
        .map_err(|e| format!("no welcome ({e}): rank 0 refused the hello (another mesh secret?)"))?;
    if !verify(secret, &[WELCOME, &ours, &rank_bytes], &welcome) {
        return Err("the welcome's MAC does not match the mesh secret".into());
    }
    Ok((reader, writer))
}
