//! Search observations: the text a search tool's hits become in the
//! conversation. The tool gateway writes it; the scripted teacher and the
//! fresh policy's copy pre-training read it. One definition, so that what
//! the policy is pre-trained and taught on is what it will be shown.

/// Characters of a document's text shown in a search hit.
pub const SNIPPET_CHARS: usize = 300;

/// Results the scripted teacher asks of each search (and copy pre-training
/// shows): enough to rank, few enough to fit an observation.
pub const SEARCH_HITS: usize = 5;

/// Documents in a submission without ids: the episode's searched hits, see [`ranking`].
pub const SUBMITTED: usize = 10;

/// One document in a search's results, as the tool renders it.
#[derive(Debug, Clone, Copy)]
pub struct Hit<'a> {
    /// The document's id, which the policy submits.
    pub id: &'a str,
    /// The document's title.
    pub title: &'a str,
    /// The document's full text (the observation shows its snippet).
    pub text: &'a str,
}

/// `tool results for "query":` then `[n] doc_id: <id> | <title>` and the
/// snippet of each hit, best first.
pub fn search_results(tool: &str, query: &str, hits: &[Hit]) -> String {
    if hits.is_empty() {
        return format!("{tool} found no documents for {query:?}.");
    }
    let mut text = format!("{tool} results for {query:?}:\n");
    for (rank, hit) in hits.iter().enumerate() {
        text.push_str(&format!("[{}] doc_id: {} | {}\n{}\n", rank + 1, hit.id, hit.title.trim(), snippet(hit.text)));
    }
    text
}

/// At most `max` characters of `text`, cut at a character boundary.
pub fn shorten(text: &str, max: usize) -> &str {
    match text.char_indices().nth(max) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

/// The leading text of a document, for search results.
pub fn snippet(text: &str) -> String {
    let text = text.trim();
    let short = shorten(text, SNIPPET_CHARS);
    if short.len() < text.len() { format!("{short}...") } else { short.to_owned() }
}

/// A hit read back from an observation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedHit {
    /// The document's id.
    pub id: String,
    /// `<title>. <snippet>`: what the observation shows of the document.
    pub text: String,
}

/// The hits of a search observation, in the order listed.
pub fn parse_search_results(observation: &str) -> Vec<ListedHit> {
    let mut hits: Vec<ListedHit> = Vec::new();
    for line in observation.lines() {
        let heading = line.split_once("] doc_id: ").filter(|(rank, _)| rank.starts_with('['));
        match (heading, hits.last_mut()) {
            (Some((_, rest)), _) => {
                let (id, title) = rest.split_once(" | ").unwrap_or((rest, ""));
                hits.push(ListedHit { id: id.trim().to_owned(), text: format!("{title}. ") });
            }
            (None, Some(hit)) => hit.text.push_str(line),
            (None, None) => {}
        }
    }
    hits
}

/// The query that follows a bridge: the first name in `hits` that none of
/// `known` (the question and the queries searched so far) holds, ignoring
/// case, after a space. The space makes the query's tokens the name's tokens
/// in the results: byte-level BPE tokenizers (GPT-2's, Qwen's, a fresh
/// policy's) fold a word's leading space into its first token, so
/// `"query": "Raklon` would spell the first word with tokens the results
/// never show, and a policy could only recall names, not copy new ones.
/// Searches ignore the space.
pub fn bridge_query(hits: &[ListedHit], known: &[String]) -> Option<String> {
    let known: Vec<String> = known.iter().map(|k| k.to_lowercase()).collect();
    let new = |name: &String| !known.iter().any(|k| k.contains(&name.to_lowercase()));
    hits.iter().flat_map(|hit| names(&hit.text)).find(new).map(|name| format!(" {name}"))
}

/// What one search of an episode found: its hits' ids, best first, of
/// which the first `shown` were in the observation (the rest were ranked
/// deeper, see `CallToolRequest.ranking_depth`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Searched {
    pub ids: Vec<String>,
    pub shown: usize,
}

/// The documents the searches of an episode found, each once, at most
/// `limit` of them: what a submission without ids ranks. First every
/// search's shown hits, the latest search's first, because a multi-hop
/// search ends at the answer, which its first search (the question) could
/// not reach; then the hits ranked below those shown, again latest first.
/// An agent that submits after its opening search so ranks exactly that
/// search's top `limit`, the depth the metric scores.
pub fn ranking(searches: &[Searched], limit: usize) -> Vec<String> {
    let shown = searches.iter().rev().flat_map(|s| &s.ids[..s.shown.min(s.ids.len())]);
    let deeper = searches.iter().rev().flat_map(|s| &s.ids[s.shown.min(s.ids.len())..]);
    let mut ranking: Vec<String> = Vec::new();
    for id in shown.chain(deeper) {
        if ranking.len() == limit {
            break;
        }
        if !ranking.contains(id) {
            ranking.push(id.clone());
        }
    }
    ranking
}

/// Runs of capitalised words in `text`, in order: names, the bridges a
/// multi-hop search follows. A single word that starts a sentence is only
/// capitalised by position, and is skipped.
pub fn names(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut run: Vec<&str> = Vec::new();
    let mut sentence_start = true;
    let mut close = |run: &mut Vec<&str>, started_sentence: bool| {
        if run.len() > 1 || (run.len() == 1 && !started_sentence) {
            found.push(run.join(" "));
        }
        run.clear();
    };
    let mut run_started_sentence = false;
    for raw in text.split_whitespace() {
        let word = raw.trim_matches(|c: char| !c.is_alphanumeric());
        let capitalised = word.chars().next().is_some_and(char::is_uppercase) && word.chars().all(char::is_alphabetic);
        if capitalised {
            if run.is_empty() {
                run_started_sentence = sentence_start;
            }
            run.push(word);
        } else {
            close(&mut run, run_started_sentence);
        }
        if !raw.ends_with(|c: char| c.is_alphanumeric()) {
            close(&mut run, run_started_sentence);
        }
        sentence_start = raw.ends_with(['.', '?', '!', ':']);
    }
    close(&mut run, run_started_sentence);
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_runs_of_capitalised_words_not_sentence_starts() {
        let text = "Klabou Atelier was started by Ada Varnok in 1903. It makes kettles. Ada enjoys Foukur.";
        assert_eq!(names(text), ["Klabou Atelier", "Ada Varnok", "Foukur"]);
    }

    #[test]
    fn a_bridge_query_is_the_first_unsearched_name_after_a_space() {
        let hits = [ListedHit { id: "o3".into(), text: "Klabou Atelier. Started by Ada Varnok in Foukur.".into() }];
        let known = |queries: &[&str]| queries.iter().map(|q| q.to_string()).collect::<Vec<_>>();
        assert_eq!(bridge_query(&hits, &known(&["Who started klabou atelier?"])).as_deref(), Some(" Ada Varnok"));
        // A followed bridge is known by its query, space and all.
        assert_eq!(bridge_query(&hits, &known(&["klabou atelier", " Ada Varnok"])).as_deref(), Some(" Foukur"));
        assert_eq!(bridge_query(&hits, &known(&["Klabou Atelier Ada Varnok Foukur"])), None);
    }

    #[test]
    fn rendered_results_parse_back_to_their_hits() {
        let long = "word ".repeat(100);
        let hits = [
            Hit { id: "o3", title: "Klabou Atelier ", text: "Started by Ada Varnok." },
            Hit { id: "p3", title: "Ada Varnok", text: &long },
        ];
        let observation = search_results("bm25_search", "who \"started\" it", &hits);
        assert!(
            observation
                .starts_with("bm25_search results for \"who \\\"started\\\" it\":\n[1] doc_id: o3 | Klabou Atelier\n")
        );
        let listed = parse_search_results(&observation);
        assert_eq!(listed[0], ListedHit { id: "o3".into(), text: "Klabou Atelier. Started by Ada Varnok.".into() });
        assert_eq!(listed[1].id, "p3");
        assert!(listed[1].text.ends_with("..."), "{}", listed[1].text);
        assert_eq!(search_results("bm25_search", "q", &[]), "bm25_search found no documents for \"q\".");
    }

    #[test]
    fn the_searched_ranking_puts_the_latest_search_first_and_each_document_once() {
        let searched =
            |ids: &[&str], shown: usize| Searched { ids: ids.iter().map(|id| (*id).to_owned()).collect(), shown };
        let ids = |ids: &[&str]| ids.iter().map(|id| (*id).to_owned()).collect::<Vec<_>>();
        let searches = [searched(&["o3", "do3"], 2), searched(&["p3", "o3"], 2), searched(&["c1"], 1)];
        assert_eq!(ranking(&searches, 10), ids(&["c1", "p3", "o3", "do3"]));
        assert_eq!(ranking(&searches, 2), ids(&["c1", "p3"]));
        assert!(ranking(&[], 10).is_empty());
        // Ranked deeper than shown: after every shown hit, latest search first.
        let deep = [searched(&["a1", "a2", "a3", "a4"], 2), searched(&["b1", "a1", "b3", "b4"], 2)];
        assert_eq!(ranking(&deep, 10), ids(&["b1", "a1", "a2", "b3", "b4", "a3", "a4"]));
        // One search ranked to the metric's depth: exactly its top 10.
        let top: Vec<String> = (1..=12).map(|i| format!("d{i}")).collect();
        let opening = [Searched { ids: top.clone(), shown: 5 }];
        assert_eq!(ranking(&opening, 10), top[..10].to_vec());
    }
}
