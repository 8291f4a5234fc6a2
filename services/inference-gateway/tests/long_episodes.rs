//! Long episodes: a turn renders and tokenises only what is new, so its cost
//! does not grow with the episode, and the tokens it appends are exactly what
//! re-rendering the whole conversation would give (SmolLM2's template and
//! tokenizer, with tools and tool calls).

use anyhow::{Context, Result, ensure};
use inference_gateway::conversation::{LastReply, Renderer};
use serde_json::{Value as Json, json};

fn tools() -> Vec<Json> {
    vec![json!({"type": "function", "function": {
        "name": "search",
        "description": "Search the documents for a query.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}
    }})]
}

/// Renders and tokenises whole conversations at once: what the recorded
/// tokens must equal while nothing drifted.
struct Whole(sleuth_chat::ChatTemplate, tokenizers::Tokenizer);

impl Whole {
    fn load(model: &std::path::Path) -> Result<Self> {
        let tokenizer = tokenizers::Tokenizer::from_file(model.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
        Ok(Self(sleuth_chat::ChatTemplate::from_dir(model)?, tokenizer))
    }

    fn tokens(&self, messages: &[Json], tools: &[Json]) -> Result<Vec<u32>> {
        let text = self.0.render(messages, tools, true)?;
        Ok(self.1.encode(text.as_str(), false).map_err(anyhow::Error::msg)?.get_ids().to_vec())
    }
}

#[test]
fn a_turn_renders_only_what_is_new_and_matches_the_whole_rendering() -> Result<()> {
    let model = sleuth_testkit::smollm2()?;
    let (renderer, whole) = (Renderer::load(&model)?, Whole::load(&model)?);
    let tools = tools();
    let system = json!({"role": "system", "content": "Answer every request by calling the search tool."});
    let observation: String = (0..30).map(|i| format!("[d{i}] Rain falls mainly on the plain. ")).collect();
    let call = r#"<tool_call>[{"name": "search", "arguments": {"query": "rain in Spain"}}]</tool_call>"#;
    let mut messages = vec![system.clone(), json!({"role": "user", "content": "Why does it rain in Spain?"})];
    let (mut seen, mut sampled, mut recorded) = (0, Vec::new(), Vec::<u32>::new());
    let mut work = Vec::new();
    for turn in 0..30 {
        let last = (seen > 0).then(|| LastReply { message: &messages[seen - 1], sampled: &sampled });
        let before = renderer.tokenised();
        let next = renderer.next_prompt(Some(&system), last, &messages[seen..], &tools)?;
        work.push(renderer.tokenised() - before);
        ensure!(!next.drift, "turn {turn} drifted");
        recorded.extend(&next.new_tokens);
        ensure!(
            recorded == whole.tokens(&messages, &tools)?,
            "turn {turn}: the prompt differs from the whole rendering"
        );

        sampled = renderer.reply_tokens(Some(&system), &tools, call)?;
        recorded.extend(&sampled);
        messages.push(json!({"role": "assistant", "content": call}));
        seen = messages.len();
        messages.push(json!({"role": "tool", "content": observation}));
    }
    // Every turn after the first renders the same amount, however long the episode.
    let (early, late) = (work[2], work[29]);
    ensure!(late <= early + 8, "turn 29 tokenised {late} tokens, turn 2 {early}: per-turn work grows ({work:?})");
    ensure!(
        recorded.len() > 10 * late as usize,
        "the episode ({} tokens) outgrew one turn (work {work:?})",
        recorded.len()
    );
    Ok(())
}

#[test]
fn an_edited_reply_is_drift_and_a_cut_reply_continues() -> Result<()> {
    let model = sleuth_testkit::smollm2()?;
    let (renderer, whole) = (Renderer::load(&model)?, Whole::load(&model)?);
    let question = json!({"role": "user", "content": "What is the capital of France?"});
    let reply = "The capital of France is Paris.";
    let sampled = renderer.reply_tokens(None, &[], reply)?;
    let follow_up = [json!({"role": "user", "content": "And of Italy?"})];
    let conversation = |content: &str| vec![question.clone(), json!({"role": "assistant", "content": content})];

    // The reply as sampled: the next prompt is the whole rendering's rest.
    let first = renderer.next_prompt(None, None, std::slice::from_ref(&question), &[])?;
    let messages = conversation(reply);
    let next =
        renderer.next_prompt(None, Some(LastReply { message: &messages[1], sampled: &sampled }), &follow_up, &[])?;
    let all: Vec<Json> = messages.iter().chain(&follow_up).cloned().collect();
    let recorded: Vec<u32> = first.new_tokens.iter().chain(&sampled).chain(&next.new_tokens).copied().collect();
    ensure!(!next.drift && recorded == whole.tokens(&all, &[])?);

    // Sampling stopped at its token limit: the reply's rest (through its
    // end-of-turn token) is context of the next turn, still without drift.
    let cut = &sampled[..3];
    let text = renderer.decode(cut)?;
    let messages = conversation(&text);
    let next = renderer.next_prompt(None, Some(LastReply { message: &messages[1], sampled: cut }), &follow_up, &[])?;
    let all: Vec<Json> = messages.iter().chain(&follow_up).cloned().collect();
    let recorded: Vec<u32> = first.new_tokens.iter().chain(cut).chain(&next.new_tokens).copied().collect();
    ensure!(!next.drift && recorded == whole.tokens(&all, &[])?, "a reply cut at the token limit continues");

    // An edited reply: drift; the next prompt is only the glue and the new message.
    let messages = conversation("Paris, of course.");
    let next =
        renderer.next_prompt(None, Some(LastReply { message: &messages[1], sampled: &sampled }), &follow_up, &[])?;
    ensure!(next.drift, "an edited reply is drift");
    let text = renderer.decode(&next.new_tokens)?;
    ensure!(text.contains("And of Italy?") && !text.contains("Paris"), "only the new message is appended: {text:?}");
    let eot = *sampled.last().context("a reply")?;
    ensure!(next.new_tokens.first() != Some(&eot), "the sampled end-of-turn token is not repeated");
    Ok(())
}
