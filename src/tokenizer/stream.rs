//! Streaming text output during generation.
//!
//! This module owns:
//! - [`StreamDecoder`]: incremental detokenization. Each pushed token id yields the newly
//!   decodable text (possibly empty). It uses the prefix-offset / read-offset technique of HF
//!   text-generation-inference and vLLM: only a small window of recent ids is decoded per step
//!   (O(window), not O(n²)), text is held back while it ends in U+FFFD (an incomplete UTF-8
//!   sequence) or while a run of `<0xNN>` byte-fallback tokens may still grow (a `ByteFallback`
//!   decoder turns a whole run into U+FFFDs if any byte in it is invalid), and HF's `clean_up_tokenization_spaces` is applied through a streaming stage.
//!   The concatenation of all deltas plus [`StreamDecoder::finish`] equals
//!   [`Tokenizer::decode`] of all ids.
//! - [`StopMatcher`]: stop strings over a stream of text deltas. Text that may still become a
//!   stop string is held back; the stop string itself is never emitted.

use super::{clean_up_tokenization, Result, TokenClass, Tokenizer};

/// Incremental detokenizer for one generated sequence.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tok: Tokenizer,
    skip_special_tokens: bool,
    /// Ids from `prefix_offset` on (older ids are dropped once they leave the window).
    ids: Vec<u32>,
    /// Start of the context window (index into `ids`).
    prefix_offset: usize,
    /// End of the already-emitted ids (index into `ids`).
    read_offset: usize,
    /// Cached `decode(ids[prefix_offset..read_offset])`.
    prefix_text: Option<String>,
    /// Streaming HF clean-up, when the tokenizer applies it.
    cleanup: Option<CleanupStage>,
    /// The last decoded (not dropped) id was a byte-fallback token: its run is still open.
    open_byte_run: bool,
}

impl StreamDecoder {
    /// A decoder for a new sequence of generated ids (the prompt is not included).
    pub fn new(tokenizer: &Tokenizer, skip_special_tokens: bool) -> Self {
        Self {
            tok: tokenizer.clone(),
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            prefix_text: None,
            cleanup: tokenizer
                .clean_up_tokenization_spaces()
                .then(CleanupStage::default),
            open_byte_run: false,
        }
    }

    fn prefix_text(&mut self) -> Result<String> {
        if let Some(t) = &self.prefix_text {
            return Ok(t.clone());
        }
        let t = self.tok.decode_raw(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        self.prefix_text = Some(t.clone());
        Ok(t)
    }

    /// Adds one id; returns the text it completes (often empty while a multi-byte character
    /// is still incomplete).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        match self.tok.stream_class(id, self.skip_special_tokens) {
            TokenClass::Dropped => {}
            TokenClass::Byte => self.open_byte_run = true,
            TokenClass::Normal => self.open_byte_run = false,
        }
        if self.open_byte_run {
            return Ok(String::new());
        }
        let prefix_text = self.prefix_text()?;
        let new_text = self
            .tok
            .decode_raw(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if new_text.len() <= prefix_text.len() || new_text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let Some(delta) = text_after(&new_text, &prefix_text) else {
            return Ok(String::new());
        };
        let delta = delta.to_string();
        // Advance the window: the ids just emitted become the next context.
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.ids.drain(..self.prefix_offset);
        self.read_offset -= self.prefix_offset;
        self.prefix_offset = 0;
        self.prefix_text = None;
        Ok(match &mut self.cleanup {
            Some(c) => c.push(&delta),
            None => delta,
        })
    }

    /// Flushes all text still held back (end of generation). The decoder can keep going
    /// afterwards, but a new sequence should use a new decoder.
    pub fn finish(&mut self) -> Result<String> {
        let prefix_text = self.prefix_text()?;
        let new_text = self
            .tok
            .decode_raw(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        let delta = if new_text.len() > prefix_text.len() {
            text_after(&new_text, &prefix_text)
                .unwrap_or_default()
                .to_string()
        } else {
            String::new()
        };
        if !self.ids.is_empty() {
            let last = self.ids.len();
            self.ids.drain(..last.saturating_sub(1));
            self.prefix_offset = 0;
            self.read_offset = self.ids.len();
            self.prefix_text = None;
        }
        Ok(match &mut self.cleanup {
            Some(c) => {
                let mut out = c.push(&delta);
                out.push_str(&c.finish());
                out
            }
            None => delta,
        })
    }
}

/// The part of `new` after `prefix`: exact when `new` starts with `prefix` (the normal case);
/// otherwise by length, like TGI/vLLM, and only at a char boundary.
fn text_after<'a>(new: &'a str, prefix: &str) -> Option<&'a str> {
    new.strip_prefix(prefix).or_else(|| new.get(prefix.len()..))
}

/// Patterns of HF `clean_up_tokenization` (all start with a space), plus the sequences where
/// replacing `" ' "` by `"'"` creates an occurrence of a later pattern (`"  ' s"` → `" 's"` →
/// `"'s"`): text matching any of these must be cleaned in one piece.
const CLEANUP_PATTERNS: [&str; 15] = [
    " .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're", "  ' m", "  ' s",
    "  ' ve", "  ' re", " n ' t",
];
/// Longest entry of `CLEANUP_PATTERNS`, minus one.
const CLEANUP_LOOKBACK: usize = 5;

/// Applies HF `clean_up_tokenization` to a stream: holds back any tail that could take part in
/// a replacement once more text arrives.
#[derive(Debug, Clone, Default)]
struct CleanupStage {
    held: String,
}

impl CleanupStage {
    fn push(&mut self, delta: &str) -> String {
        self.held.push_str(delta);
        let cut = cleanup_split_point(&self.held);
        let out = clean_up_tokenization(&self.held[..cut]);
        self.held.drain(..cut);
        out
    }

    fn finish(&mut self) -> String {
        let out = clean_up_tokenization(&self.held);
        self.held.clear();
        out
    }
}

/// Largest `cut` such that `text[..cut]` can be cleaned independently of what follows: no
/// (possibly incomplete) pattern occurrence starts before `cut` and extends past it.
fn cleanup_split_point(text: &str) -> usize {
    let b = text.as_bytes();
    let len = b.len();
    // Earliest start of an incomplete pattern occurrence reaching the end.
    let mut cut = len;
    for i in len.saturating_sub(CLEANUP_LOOKBACK)..len {
        let tail = &b[i..];
        if CLEANUP_PATTERNS
            .iter()
            .any(|p| p.len() > tail.len() && p.as_bytes().starts_with(tail))
        {
            cut = i;
            break;
        }
    }
    // Move back over complete occurrences that straddle the cut.
    while let Some(a) = (cut.saturating_sub(CLEANUP_LOOKBACK)..cut).find(|&a| {
        CLEANUP_PATTERNS
            .iter()
            .any(|p| b[a..].starts_with(p.as_bytes()) && a + p.len() > cut)
    }) {
        cut = a;
    }
    // Patterns are ASCII, so `cut` is at an ASCII byte or the end: always a char boundary.
    cut
}

/// Result of feeding text to a [`StopMatcher`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text that is safe to show now.
    pub emit: String,
    /// A stop string was completed; generation should end. Later pushes emit nothing.
    pub stopped: bool,
}

/// Stop-string detection over streamed text.
///
/// For any split of a text into deltas, the concatenation of all `emit`s (plus
/// [`flush`](Self::flush)) equals the text truncated before the earliest occurrence of any stop
/// string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    max_len: usize,
    buf: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        let mut uniq: Vec<String> = Vec::new();
        for s in stops {
            if !s.is_empty() && !uniq.contains(&s) {
                uniq.push(s);
            }
        }
        let max_len = uniq.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops: uniq,
            max_len,
            buf: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string has been seen.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Earliest complete occurrence of any stop string in the buffer.
    fn complete_at(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|s| self.buf.find(s.as_str()))
            .min()
    }

    /// Earliest position from which the rest of the buffer is a proper prefix of a stop string.
    fn partial_at(&self) -> Option<usize> {
        let len = self.buf.len();
        let from = len.saturating_sub(self.max_len.saturating_sub(1));
        self.buf
            .char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= from)
            .find(|&i| {
                let tail = &self.buf[i..];
                self.stops
                    .iter()
                    .any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
    }

    /// Feeds the next piece of text.
    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.stopped {
            return StopOutput {
                emit: String::new(),
                stopped: true,
            };
        }
        self.buf.push_str(delta);
        let complete = self.complete_at();
        let partial = self.partial_at();
        match (complete, partial) {
            (Some(c), p) if p.is_none_or(|p| c <= p) => {
                let emit = self.buf[..c].to_string();
                self.buf.clear();
                self.stopped = true;
                StopOutput {
                    emit,
                    stopped: true,
                }
            }
            (_, Some(p)) => {
                let emit: String = self.buf.drain(..p).collect();
                StopOutput {
                    emit,
                    stopped: false,
                }
            }
            (_, None) => StopOutput {
                emit: std::mem::take(&mut self.buf),
                stopped: false,
            },
        }
    }

    /// Returns the held-back text when generation ends for another reason (EOS, length).
    pub fn flush(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        match self.complete_at() {
            Some(c) => {
                self.stopped = true;
                let out = self.buf[..c].to_string();
                self.buf.clear();
                out
            }
            None => std::mem::take(&mut self.buf),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::{byte_level_tokenizer, metaspace_tokenizer};

    /// Small deterministic PRNG (xorshift64*), to avoid a dev-dependency.
    pub(crate) struct Rng(u64);
    impl Rng {
        pub(crate) fn new(seed: u64) -> Self {
            Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        pub(crate) fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// Streams `ids` and checks the concatenation against `decode`.
    pub(crate) fn check_stream(tok: &Tokenizer, ids: &[u32], skip: bool) {
        let mut d = StreamDecoder::new(tok, skip);
        let mut out = String::new();
        for &id in ids {
            out.push_str(&d.push(id).unwrap());
        }
        out.push_str(&d.finish().unwrap());
        let want = tok.decode(ids, skip).unwrap();
        assert_eq!(out, want, "ids {ids:?} skip={skip}");
    }

    #[test]
    fn stream_random_ids_byte_level() {
        for clean in [false, true] {
            let tok = byte_level_tokenizer(clean);
            let n = tok.vocab_size() as u32;
            let mut rng = Rng::new(7 + clean as u64);
            for _ in 0..300 {
                let len = 1 + rng.below(40);
                let ids: Vec<u32> = (0..len)
                    .map(|_| {
                        if rng.below(8) == 0 {
                            263 + rng.below(2) as u32
                        } else {
                            rng.below(n as usize - 2) as u32
                        }
                    })
                    .collect();
                check_stream(&tok, &ids, false);
                check_stream(&tok, &ids, true);
            }
        }
    }

    #[test]
    fn stream_multibyte_text() {
        let tok = byte_level_tokenizer(true);
        for text in [
            "héllo wörld 日本語 🦀🦀 the end.",
            "I don 't know , he 's here . Isn 't it ?",
            "a ' b  ' c ''' n't 's 're 've 'm  .",
        ] {
            let ids = tok.encode(text, true).unwrap();
            check_stream(&tok, &ids, true);
            check_stream(&tok, &ids, false);
        }
        // the deltas never contain a broken character and multi-byte chars come out whole
        let ids = tok.encode("🦀", false).unwrap();
        assert!(ids.len() >= 4);
        let mut d = StreamDecoder::new(&tok, false);
        let deltas: Vec<String> = ids.iter().map(|&i| d.push(i).unwrap()).collect();
        assert_eq!(deltas.concat(), "🦀");
        assert!(deltas.iter().all(|s| s.is_empty() || s == "🦀"));
    }

    #[test]
    fn stream_random_ids_metaspace() {
        let tok = metaspace_tokenizer();
        let n = tok.vocab_size();
        let mut rng = Rng::new(99);
        for _ in 0..300 {
            let len = 1 + rng.below(30);
            let ids: Vec<u32> = (0..len).map(|_| rng.below(n) as u32).collect();
            check_stream(&tok, &ids, false);
            check_stream(&tok, &ids, true);
        }
        let ids = tok.encode("Hello wéorld 🦀 Hello", true).unwrap();
        check_stream(&tok, &ids, true);
    }

    #[test]
    fn stream_window_stays_small() {
        let tok = byte_level_tokenizer(false);
        let ids = tok
            .encode(&"the world is hello ".repeat(200), false)
            .unwrap();
        let mut d = StreamDecoder::new(&tok, false);
        for &id in &ids {
            d.push(id).unwrap();
            assert!(d.ids.len() <= 8, "window grew to {}", d.ids.len());
        }
    }

    #[test]
    fn cleanup_stage_matches_batch() {
        let alphabet = [
            " ", " ", "'", "n", "t", "m", "s", "v", "e", "r", ".", "?", ",", "a", "é", "!",
        ];
        let mut rng = Rng::new(3);
        for _ in 0..50_000 {
            let len = rng.below(24);
            let text: String = (0..len)
                .map(|_| alphabet[rng.below(alphabet.len())])
                .collect();
            let mut stage = CleanupStage::default();
            let mut out = String::new();
            let mut rest = text.as_str();
            while !rest.is_empty() {
                let mut k = 1 + rng.below(rest.len());
                while !rest.is_char_boundary(k) {
                    k += 1;
                }
                out.push_str(&stage.push(&rest[..k]));
                rest = &rest[k..];
            }
            out.push_str(&stage.finish());
            assert_eq!(out, clean_up_tokenization(&text), "text {text:?}");
        }
    }

    fn reference_truncate<'a>(text: &'a str, stops: &[String]) -> &'a str {
        let cut = stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s.as_str()))
            .min()
            .unwrap_or(text.len());
        &text[..cut]
    }

    #[test]
    fn stop_matcher_property() {
        let alphabet = ['a', 'b', 'c', 'é', '日', '\n'];
        let mut rng = Rng::new(11);
        for _ in 0..5000 {
            let pick = |rng: &mut Rng, max: usize| -> String {
                let n = rng.below(max + 1);
                (0..n)
                    .map(|_| alphabet[rng.below(alphabet.len())])
                    .collect()
            };
            let text = pick(&mut rng, 20);
            let nstops = rng.below(4);
            let stops: Vec<String> = (0..nstops).map(|_| pick(&mut rng, 4)).collect();
            let mut m = StopMatcher::new(stops.clone());
            let mut out = String::new();
            let mut rest = text.as_str();
            let mut stopped = false;
            while !rest.is_empty() {
                let mut k = 1 + rng.below(rest.len());
                while !rest.is_char_boundary(k) {
                    k += 1;
                }
                let o = m.push(&rest[..k]);
                if stopped {
                    assert!(o.emit.is_empty() && o.stopped);
                }
                out.push_str(&o.emit);
                stopped |= o.stopped;
                rest = &rest[k..];
            }
            out.push_str(&m.flush());
            let want = reference_truncate(&text, &stops);
            assert_eq!(out, want, "text {text:?} stops {stops:?}");
            let has_stop = want.len() < text.len()
                || stops
                    .iter()
                    .any(|s| !s.is_empty() && text.contains(s.as_str()));
            assert_eq!(m.is_stopped(), has_stop, "text {text:?} stops {stops:?}");
        }
    }

    #[test]
    fn stop_matcher_examples() {
        let mut m = StopMatcher::new(vec!["</s>".into(), "\n\nUser:".into()]);
        assert_eq!(m.push("Hello <").emit, "Hello ");
        assert_eq!(m.push("/").emit, "");
        let o = m.push("s> more");
        assert_eq!(
            o,
            StopOutput {
                emit: String::new(),
                stopped: true
            }
        );
        assert_eq!(
            m.push("x"),
            StopOutput {
                emit: String::new(),
                stopped: true
            }
        );
        assert_eq!(m.flush(), "");

        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("abc ST").emit, "abc ");
        assert_eq!(m.push("x").emit, "STx");
        assert_eq!(m.push("ST").emit, "");
        assert_eq!(m.flush(), "ST");

        let mut m = StopMatcher::new(vec![]);
        assert_eq!(m.push("anything").emit, "anything");
        let mut m = StopMatcher::new(vec!["".into()]);
        assert_eq!(m.push("x").emit, "x");
    }

    #[test]
    fn fixtures_stream_matches_decode() {
        use crate::tokenizer::tests::{cases, ids_of, load_fixture, FIXTURES};
        for name in FIXTURES {
            let (tok, r) = load_fixture(name);
            for d in cases(&r, "decode") {
                let ids = ids_of(&d["ids"]);
                let skip = d["skip_special_tokens"].as_bool().unwrap();
                let mut dec = StreamDecoder::new(&tok, skip);
                let mut out = String::new();
                for &id in &ids {
                    let delta = dec.push(id).unwrap();
                    out.push_str(&delta);
                }
                out.push_str(&dec.finish().unwrap());
                assert_eq!(out, d["text"].as_str().unwrap(), "{name}: {ids:?}");
            }
            for p in cases(&r, "prompts") {
                for skip in [false, true] {
                    check_stream(&tok, &ids_of(&p["ids"]), skip);
                    check_stream(&tok, &ids_of(&p["greedy"]), skip);
                }
            }
            for c in cases(&r, "chat") {
                check_stream(&tok, &ids_of(&c["ids"]), false);
                check_stream(&tok, &ids_of(&c["ids"]), true);
            }
            // random ids over the whole vocabulary, specials included
            let mut rng = Rng::new(name.len() as u64);
            for _ in 0..200 {
                let len = 1 + rng.below(48);
                let ids: Vec<u32> = (0..len)
                    .map(|_| rng.below(tok.vocab_size()) as u32)
                    .collect();
                check_stream(&tok, &ids, false);
                check_stream(&tok, &ids, true);
            }
        }
    }

    #[test]
    fn fixture_partial_utf8_is_held() {
        // README: `日本` is [291, 299]; 291 alone decodes to U+FFFD.
        let (tok, _) = crate::tokenizer::tests::load_fixture("llama3");
        let mut d = StreamDecoder::new(&tok, true);
        assert_eq!(d.push(291).unwrap(), "");
        assert_eq!(d.push(299).unwrap(), "日本");
        assert_eq!(d.finish().unwrap(), "");
    }
}
