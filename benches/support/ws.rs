//! A minimal WebSocket client (RFC 6455) on tokio for the pub/sub benches:
//! the same client drives every server, so a comparison measures the server.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// A masked client frame.
pub fn frame(op: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(payload.len() + 14);
    f.push(0x80 | op);
    let len = payload.len();
    if len < 126 {
        f.push(0x80 | len as u8);
    } else if len <= 65535 {
        f.push(0x80 | 126);
        f.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        f.push(0x80 | 127);
        f.extend_from_slice(&(len as u64).to_be_bytes());
    }
    let mask = [0x12u8, 0x34, 0x56, 0x78];
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i & 3]));
    f
}

/// One server frame at the start of `b`: (opcode, payload range, bytes used).
pub fn parse(b: &[u8]) -> Option<(u8, std::ops::Range<usize>, usize)> {
    if b.len() < 2 {
        return None;
    }
    let (len, at) = match b[1] & 0x7f {
        126 => (u16::from_be_bytes([*b.get(2)?, *b.get(3)?]) as usize, 4),
        127 => (
            u64::from_be_bytes(b.get(2..10)?.try_into().ok()?) as usize,
            10,
        ),
        n => (n as usize, 2),
    };
    if b.len() < at + len {
        return None;
    }
    Some((b[0] & 0x0f, at..at + len, at + len))
}

pub struct Ws {
    pub rd: OwnedReadHalf,
    pub wr: OwnedWriteHalf,
    buf: Vec<u8>,
    pos: usize,
}

impl Ws {
    pub async fn connect(addr: &str, path: &str) -> std::io::Result<Ws> {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::with_capacity(4096);
        let mut chunk = [0u8; 2048];
        let end = loop {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Err(std::io::Error::other("closed during handshake"));
            }
            buf.extend_from_slice(&chunk[..n]);
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
        };
        if !buf.starts_with(b"HTTP/1.1 101") {
            return Err(std::io::Error::other(
                String::from_utf8_lossy(&buf[..end]).to_string(),
            ));
        }
        buf.drain(..end);
        let (rd, wr) = s.into_split();
        Ok(Ws {
            rd,
            wr,
            buf,
            pos: 0,
        })
    }

    pub async fn send(&mut self, op: u8, payload: &[u8]) -> std::io::Result<()> {
        self.wr.write_all(&frame(op, payload)).await
    }

    /// Calls `f(opcode, payload)` for every complete frame, reading once if none is buffered.
    pub async fn read_frames(&mut self, mut f: impl FnMut(u8, &[u8])) -> std::io::Result<()> {
        let mut any = false;
        loop {
            while let Some((op, range, used)) = parse(&self.buf[self.pos..]) {
                let base = self.pos;
                f(op, &self.buf[base + range.start..base + range.end]);
                self.pos += used;
                any = true;
            }
            if self.pos > 0 {
                self.buf.drain(..self.pos);
                self.pos = 0;
            }
            if any {
                return Ok(());
            }
            let old = self.buf.len();
            self.buf.resize(old + 65536, 0);
            let n = self.rd.read(&mut self.buf[old..]).await?;
            self.buf.truncate(old + n);
            if n == 0 {
                return Err(std::io::Error::other("connection closed"));
            }
        }
    }
}
