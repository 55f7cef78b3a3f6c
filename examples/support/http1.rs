//! The HTTP/1.1 answer reader the load examples share (`#[path]`-included: not an example
//! of its own). Content-Length framing only, which quotad always sends.

use tokio::io::{AsyncRead, AsyncReadExt};

/// Reads one response into `buf` (left holding whatever follows it) and hands its status
/// and body to `f`, without copying the body.
pub async fn read_response<S, T>(
    s: &mut S,
    buf: &mut Vec<u8>,
    f: impl FnOnce(u16, &[u8]) -> T,
) -> std::io::Result<T>
where
    S: AsyncRead + Unpin,
{
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = &buf[..end];
            let status = head
                .split(|&b| b == b' ')
                .nth(1)
                .and_then(|s| std::str::from_utf8(s).ok()?.parse().ok())
                .unwrap_or(0);
            let length = head
                .split(|&b| b == b'\n')
                .find_map(|line| {
                    let (name, value) = std::str::from_utf8(line).ok()?.split_once(':')?;
                    if name.eq_ignore_ascii_case("content-length") {
                        value.trim().parse::<usize>().ok()
                    } else {
                        None
                    }
                })
                .unwrap_or(0);
            let total = end + 4 + length;
            while buf.len() < total {
                read_more(s, buf).await?;
            }
            let out = f(status, &buf[end + 4..total]);
            buf.drain(..total);
            return Ok(out);
        }
        read_more(s, buf).await?;
    }
}

async fn read_more<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> std::io::Result<()> {
    let mut chunk = [0u8; 4096];
    let n = s.read(&mut chunk).await?;
    if n == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    buf.extend_from_slice(&chunk[..n]);
    Ok(())
}
