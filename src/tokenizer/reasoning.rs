//! Reasoning text in a model's output: `<think>…</think>` (Qwen3, DeepSeek-R1, QwQ and
//! others) split off the answer, whole or while the text streams in, for the API's
//! `reasoning_content`.
//!
//! A reply may open with `<think>`, or start inside the block when the chat template put
//! `<think>` at the end of the prompt (DeepSeek-R1, Qwen3 thinking templates): then the
//! model only writes `</think>`. Text after the block is the answer; a reply that never
//! closes the block is all reasoning.
use super::tool_calls::partial_tag_suffix;

const START: &str = "<think>";
const END: &str = "</think>";

/// Whether a chat template uses `<think>` blocks.
pub fn template_has_reasoning(template: &str) -> bool {
    template.contains(START) && template.contains(END)
}

/// Whether a rendered prompt leaves the model inside a `<think>` block.
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    match (prompt.rfind(START), prompt.rfind(END)) {
        (Some(s), Some(e)) => s > e,
        (Some(_), None) => true,
        _ => false,
    }
}

/// A piece of a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReasoningEvent {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    /// Nothing but blanks seen: a `<think>` may still come.
    Start,
    Reasoning,
    /// Just after `</think>`: the blank lines before the answer are dropped.
    AfterReasoning,
    Content,
}

/// Splits a streaming reply into reasoning and content.
#[derive(Debug)]
pub struct ReasoningStream {
    state: State,
    buf: String,
}

impl ReasoningStream {
    /// `in_reasoning`: the prompt already opened the block ([`prompt_opens_reasoning`]).
    pub fn new(in_reasoning: bool) -> Self {
        ReasoningStream {
            state: if in_reasoning {
                State::Reasoning
            } else {
                State::Start
            },
            buf: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<ReasoningEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(START) {
                        self.buf = rest.to_string();
                        self.state = State::Reasoning;
                        continue;
                    }
                    if !t.is_empty() && !START.starts_with(t) {
                        self.state = State::Content;
                        continue;
                    }
                    break;
                }
                State::Reasoning => {
                    if let Some(i) = self.buf.find(END) {
                        let r: String = self.buf.drain(..i).collect();
                        self.buf.drain(..END.len());
                        emit(&mut out, ReasoningEvent::Reasoning(r));
                        self.state = State::AfterReasoning;
                        continue;
                    }
                    let keep = partial_tag_suffix(&self.buf, END);
                    let r: String = self.buf.drain(..self.buf.len() - keep).collect();
                    emit(&mut out, ReasoningEvent::Reasoning(r));
                    break;
                }
                State::AfterReasoning => {
                    self.buf = self.buf.trim_start().to_string();
                    if self.buf.is_empty() {
                        break;
                    }
                    self.state = State::Content;
                }
                State::Content => {
                    emit(
                        &mut out,
                        ReasoningEvent::Content(std::mem::take(&mut self.buf)),
                    );
                    break;
                }
            }
        }
        out
    }

    pub fn finish(&mut self) -> Vec<ReasoningEvent> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match self.state {
            State::Reasoning => emit(&mut out, ReasoningEvent::Reasoning(rest)),
            _ => emit(&mut out, ReasoningEvent::Content(rest)),
        }
        out
    }
}

fn emit(out: &mut Vec<ReasoningEvent>, e: ReasoningEvent) {
    match (&e, out.last_mut()) {
        (ReasoningEvent::Reasoning(s) | ReasoningEvent::Content(s), _) if s.is_empty() => {}
        (ReasoningEvent::Reasoning(s), Some(ReasoningEvent::Reasoning(l)))
        | (ReasoningEvent::Content(s), Some(ReasoningEvent::Content(l))) => l.push_str(s),
        _ => out.push(e),
    }
}

/// Split a whole reply: `(reasoning, content)`.
pub fn split_reasoning(text: &str, in_reasoning: bool) -> (Option<String>, String) {
    let mut s = ReasoningStream::new(in_reasoning);
    let mut events = s.push(text);
    events.extend(s.finish());
    let (mut reasoning, mut content) = (None::<String>, String::new());
    for e in events {
        match e {
            ReasoningEvent::Reasoning(r) => reasoning.get_or_insert_with(String::new).push_str(&r),
            ReasoningEvent::Content(c) => content.push_str(&c),
        }
    }
    (reasoning, content)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(text: &str, in_reasoning: bool) -> (Option<String>, String) {
        let whole = split_reasoning(text, in_reasoning);
        let chars: Vec<char> = text.chars().collect();
        for step in 1..=6 {
            let mut s = ReasoningStream::new(in_reasoning);
            let mut events = Vec::new();
            for piece in chars.chunks(step) {
                events.extend(s.push(&piece.iter().collect::<String>()));
            }
            events.extend(s.finish());
            let (mut r, mut c) = (None::<String>, String::new());
            for e in events {
                match e {
                    ReasoningEvent::Reasoning(x) => r.get_or_insert_with(String::new).push_str(&x),
                    ReasoningEvent::Content(x) => c.push_str(&x),
                }
            }
            assert_eq!((r, c), whole, "pieces of {step}: {text:?}");
        }
        whole
    }

    #[test]
    fn splits_think_blocks() {
        assert_eq!(
            streamed("<think>\nSimple sum.\n</think>\n\n4", false),
            (Some("\nSimple sum.\n".into()), "4".into())
        );
        // the prompt opened the block
        assert_eq!(
            streamed("2 and 2 make 4.</think>\n\nIt is 4.", true),
            (Some("2 and 2 make 4.".into()), "It is 4.".into())
        );
        // no block at all
        assert_eq!(streamed("Just 4.", false), (None, "Just 4.".into()));
        // unterminated: all reasoning
        assert_eq!(
            streamed("<think>still going", false),
            (Some("still going".into()), String::new())
        );
        // a `<think>` later in the answer is content
        assert_eq!(
            streamed("Use <think> tags.", false),
            (None, "Use <think> tags.".into())
        );
    }

    #[test]
    fn prompt_and_template_checks() {
        assert!(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_reasoning(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n"));
        assert!(template_has_reasoning("{{ '<think>' }}…{{ '</think>' }}"));
        assert!(!template_has_reasoning("{{ messages }}"));
    }
}
