//! Server-sent events, read as their bytes come: the one reader of the
//! client's streams and of those the gateway forwards, so that what either
//! records of a stream is what an agent's SDK reads in it.
//!
//! As the HTML standard reads an event stream: a line ends at LF, CR or
//! CRLF; a blank line ends an event; the `data:` lines of an event are
//! joined by LF, less the one space after the colon; comments (`:`) and
//! other fields are skipped; an event without data is none; a byte order
//! mark may open the stream; what comes after the last blank line when the
//! stream ends is no event (it was cut); bytes that are not UTF-8 read as
//! U+FFFD. Beyond the standard, a line or an event's data longer than
//! [`LINE_LIMIT`] is an error, so that a stream that never ends a line
//! cannot fill the memory.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures_util::Stream;

/// The longest line of a stream that is read (an event's `data:`), and
/// the most data of one event.
pub(crate) const LINE_LIMIT: usize = 4 << 20;

/// The byte order mark, in UTF-8.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// A stream that cannot be read into events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TooLong {
    #[error("a line of the stream is longer than {} MiB", LINE_LIMIT >> 20)]
    Line,
    #[error("an event of the stream is longer than {} MiB", LINE_LIMIT >> 20)]
    Event,
}

/// Reads events out of the bytes pushed into it, chunks cut anywhere; as
/// an iterator, the data of each event whole so far. After an error the
/// stream is not to be read further: what was held is dropped.
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    /// Bytes pushed and not yet read into lines: those before `read` are
    /// read, and of the rest the first `scanned` hold no line's end.
    buffer: Vec<u8>,
    read: usize,
    scanned: usize,
    /// The last line ended with a CR: an LF that comes next is its end too.
    after_cr: bool,
    /// A line was read, so a byte order mark no longer opens the stream.
    started: bool,
    /// The data of the event being read, each line followed by an LF.
    data: String,
}

impl Decoder {
    /// More bytes of the stream.
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// Whether nothing of a line or an event is held.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.buffer.len() == self.read && self.data.is_empty()
    }

    /// The bytes held, as memory: for tests that bound it.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.buffer.capacity() + self.data.capacity()
    }

    /// Keeps only the line not yet whole, until more bytes come.
    fn wait(&mut self) -> Option<Result<String, TooLong>> {
        self.buffer.drain(..self.read);
        self.read = 0;
        if self.buffer.len() > LINE_LIMIT {
            return self.fail(TooLong::Line);
        }
        None
    }

    /// Drops what is held, after an error.
    fn fail(&mut self, error: TooLong) -> Option<Result<String, TooLong>> {
        *self = Self {
            started: true,
            ..Self::default()
        };
        Some(Err(error))
    }
}

impl Iterator for Decoder {
    type Item = Result<String, TooLong>;

    /// The next whole event's data, or `None` until more bytes come.
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.after_cr {
                match self.buffer.get(self.read) {
                    None => return self.wait(),
                    Some(b'\n') => self.read += 1,
                    Some(_) => {}
                }
                self.after_cr = false;
            }
            let from = self.read + self.scanned;
            let Some(at) = self.buffer[from..]
                .iter()
                .position(|b| matches!(b, b'\n' | b'\r'))
            else {
                self.scanned = self.buffer.len() - self.read;
                return self.wait();
            };
            let end = from + at;
            let line = &self.buffer[self.read..end];
            self.after_cr = self.buffer[end] == b'\r';
            self.read = end + 1;
            self.scanned = 0;
            let line = match line.strip_prefix(BOM) {
                Some(rest) if !self.started => rest,
                _ => line,
            };
            self.started = true;
            if line.is_empty() {
                if self.data.is_empty() {
                    continue;
                }
                let mut data = std::mem::take(&mut self.data);
                data.pop();
                return Some(Ok(data));
            }
            let (name, value) = match line.iter().position(|b| *b == b':') {
                Some(0) => continue,
                Some(colon) => {
                    let value = &line[colon + 1..];
                    (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
                }
                None => (line, &[][..]),
            };
            if name != b"data" {
                continue;
            }
            self.data.push_str(&String::from_utf8_lossy(value));
            self.data.push('\n');
            if self.data.len() > LINE_LIMIT {
                return self.fail(TooLong::Event);
            }
        }
    }
}

/// Why a stream's events stopped before its end.
#[derive(Debug)]
pub(crate) enum Broken<E> {
    /// Its bytes stopped: the connection failed.
    Transport(E),
    TooLong(TooLong),
}

/// The events of a stream of bytes (a response's body), each as its data.
pub(crate) struct Events<S> {
    bytes: S,
    decoder: Decoder,
    ended: bool,
}

impl<S> Events<S> {
    pub(crate) fn new(bytes: S) -> Self {
        Self {
            bytes,
            decoder: Decoder::default(),
            ended: false,
        }
    }
}

impl<S, B, E> Stream for Events<S>
where
    S: Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
{
    type Item = Result<String, Broken<E>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(event) = this.decoder.next() {
                return Poll::Ready(Some(event.map_err(Broken::TooLong)));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.bytes).poll_next(cx)) {
                Some(Ok(bytes)) => this.decoder.push(bytes.as_ref()),
                Some(Err(err)) => return Poll::Ready(Some(Err(Broken::Transport(err)))),
                None => this.ended = true,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The events of `stream` pushed `at` bytes at a time.
    fn events(stream: &[u8], at: usize) -> Vec<Result<String, TooLong>> {
        let mut decoder = Decoder::default();
        let mut events = Vec::new();
        for piece in stream.chunks(at) {
            decoder.push(piece);
            events.extend(&mut decoder);
        }
        events
    }

    fn data(events: &[&str]) -> Vec<Result<String, TooLong>> {
        events.iter().map(|e| Ok((*e).to_owned())).collect()
    }

    #[test]
    fn events_are_read_the_same_however_their_bytes_are_cut() {
        let stream = "data: {\"a\":1}\n\ndata: {\"b\":\r\ndata: 2}\r\n\r\ndata: [DONE]\r\r";
        let read = data(&["{\"a\":1}", "{\"b\":\n2}", "[DONE]"]);
        for at in 1..=stream.len() {
            assert_eq!(events(stream.as_bytes(), at), read, "{at}");
        }
    }

    #[test]
    fn comments_other_fields_and_events_without_data_are_no_events() {
        let stream = b": ping\n\nevent: response.completed\nid: 7\nretry: 10\ndata:x\n\n\n\nevent: e\n\ndata\n\n";
        assert_eq!(events(stream, 5), data(&["x", ""]));
    }

    #[test]
    fn a_byte_order_mark_opens_the_stream_and_nothing_else() {
        let stream = b"\xEF\xBB\xBFdata: a\n\n\xEF\xBB\xBFdata: b\n\ndata: c\n\n";
        assert_eq!(events(stream, 2), data(&["a", "c"]));
    }

    #[test]
    fn an_event_cut_before_its_blank_line_is_none() {
        assert_eq!(events(b"data: a\n\ndata: [DONE]\n", 4), data(&["a"]));
    }

    #[test]
    fn bytes_that_are_not_utf8_read_as_replacement_characters() {
        assert_eq!(
            events(b"data: \xC3\xA9\xFF\n\n", 1),
            data(&["\u{e9}\u{fffd}"])
        );
    }

    #[test]
    fn a_line_or_an_event_past_the_limit_is_an_error() {
        let mut decoder = Decoder::default();
        decoder.push(&vec![b'x'; LINE_LIMIT + 1]);
        assert_eq!(decoder.next(), Some(Err(TooLong::Line)));
        assert!(decoder.is_empty());
        let line = format!("data: {}\n", "x".repeat(1 << 20));
        let mut decoder = Decoder::default();
        for _ in 0..4 {
            decoder.push(line.as_bytes());
        }
        assert_eq!(decoder.next(), Some(Err(TooLong::Event)));
        assert!(decoder.is_empty());
    }

    #[tokio::test]
    async fn a_body_gives_its_events_then_how_it_broke() {
        let chunks: Vec<Result<&[u8], &str>> =
            vec![Ok(b"data: a\n\ndata: "), Ok(b"b\n\ndata: c"), Err("reset")];
        let mut events = Events::new(futures_util::stream::iter(chunks));
        let mut read = Vec::new();
        while let Some(event) = futures_util::StreamExt::next(&mut events).await {
            read.push(event.map_err(|err| format!("{err:?}")));
        }
        assert_eq!(
            read,
            [
                Ok("a".to_owned()),
                Ok("b".to_owned()),
                Err("Transport(\"reset\")".to_owned())
            ]
        );
    }
}
