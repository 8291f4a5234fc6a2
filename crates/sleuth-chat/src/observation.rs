//! Search observations: the text a search tool's hits become in the
//! conversation. The tool gateway writes it; the scripted teacher and the
//! fresh policy's copy pre-training read it. One definition, so that what
//! the policy is pre-trained and taught on is what it will be shown.

/// Characters of a document's text shown in a search hit.
pub const SNIPPET_CHARS: usize = 300;

/// Results the scripted teacher asks of each search (and copy pre-training
/// shows): enough to rank, few enough to fit an observation.
pub const SEARCH_HITS: usize = 5;

/// The most leads listed under a search's results (`follow_lead` takes
/// their numbers).
pub const LEADS: usize = 3;

/// What the line listing a search's leads starts with.
const LEADS_HEADING: &str = "Leads to follow: ";

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

/// Whether a search observation shows hit `id`: every hit it lists, unless
/// the observation cap `truncated` it, when only those whose line
/// ([`search_results`]) survived the cut were shown.
pub fn shows(observation: &str, truncated: bool, id: &str) -> bool {
    !truncated || observation.contains(&format!("doc_id: {id}"))
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

/// `observation` with a last line listing `leads` (bridges, most salient
/// first; see `crate::bridge::bridges`), numbered from 1 as `follow_lead`
/// takes them: `Leads to follow: 1. Ada Varnok; 2. regatta`. At most
/// [`LEADS`]; none leaves the observation as it is.
pub fn with_leads(observation: &str, leads: &[String]) -> String {
    let listed: Vec<String> =
        leads.iter().take(LEADS).enumerate().map(|(i, lead)| format!("{}. {}", i + 1, lead.trim())).collect();
    if listed.is_empty() {
        return observation.to_owned();
    }
    let newline = if observation.is_empty() || observation.ends_with('\n') { "" } else { "\n" };
    format!("{observation}{newline}{LEADS_HEADING}{}\n", listed.join("; "))
}

/// The leads [`with_leads`] listed in `observation`, in order (none when it lists none).
pub fn parse_leads(observation: &str) -> Vec<String> {
    let Some(line) = observation.lines().rev().find_map(|line| line.strip_prefix(LEADS_HEADING)) else {
        return Vec::new();
    };
    line.split("; ")
        .enumerate()
        .filter_map(|(i, lead)| lead.strip_prefix(&format!("{}. ", i + 1)).map(str::to_owned))
        .collect()
}

/// A hit read back from an observation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedHit {
    /// The document's id.
    pub id: String,
    /// The document's title as shown.
    pub title: String,
    /// `<title>. <snippet>`: what the observation shows of the document.
    pub text: String,
}

/// The hits of a search observation, in the order listed (its leads are
/// no hit's text).
pub fn parse_search_results(observation: &str) -> Vec<ListedHit> {
    let mut hits: Vec<ListedHit> = Vec::new();
    for line in observation.lines().take_while(|line| !line.starts_with(LEADS_HEADING)) {
        let heading = line.split_once("] doc_id: ").filter(|(rank, _)| rank.starts_with('['));
        match (heading, hits.last_mut()) {
            (Some((_, rest)), _) => {
                let (id, title) = rest.split_once(" | ").unwrap_or((rest, ""));
                let title = title.trim().to_owned();
                hits.push(ListedHit { id: id.trim().to_owned(), text: format!("{title}. "), title });
            }
            (None, Some(hit)) => hit.text.push_str(line),
            (None, None) => {}
        }
    }
    hits
}

/// What one search of an episode found: its hits' ids, best first, of
/// which the first `shown` were in the observation (the rest were ranked
/// deeper, see `CallToolRequest.ranking_depth`), and, for a search of a
/// name the previous search's results showed (a lead followed, a name the
/// model read), the hit it was read in.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Searched {
    /// The hits' document ids, best first.
    pub ids: Vec<String>,
    /// How many of `ids`, from the first, the observation showed.
    pub shown: usize,
    /// The document whose text showed this search's query: the link of a
    /// multi-hop chain that names the next entity.
    pub link: Option<String>,
}

/// The documents the searches of an episode found, each once, at most
/// `limit` of them: what a submission without ids ranks. A chain of
/// searched names comes first: the latest search's first hit (the page of
/// the entity the chain ended at), then each search's link (the document
/// its name was read in), latest first. Those are the chain's evidence, as
/// a multi-hop question's supporting documents are the pages its bridges
/// were read on and the answer's own (HotpotQA's supporting facts); ranked
/// by search alone they sat five hits apart, the opening one at rank 11
/// after two hops, past the metric's depth. Then every search's shown
/// hits, the latest search's first, because a multi-hop search ends at the
/// answer, which its first search (the question) could not reach; then the
/// hits ranked below those shown, again latest first. An agent that
/// submits after its opening search (no link) so ranks exactly that
/// search's top `limit`, the depth the metric scores.
pub fn ranking(searches: &[Searched], limit: usize) -> Vec<String> {
    let links: Vec<&String> = searches.iter().rev().filter_map(|s| s.link.as_ref()).collect();
    let ended_at = searches.last().and_then(|s| s.ids.first()).filter(|_| !links.is_empty());
    let chain = ended_at.into_iter().chain(links);
    let shown = searches.iter().rev().flat_map(|s| &s.ids[..s.shown.min(s.ids.len())]);
    let deeper = searches.iter().rev().flat_map(|s| &s.ids[s.shown.min(s.ids.len())..]);
    let mut ranking: Vec<String> = Vec::new();
    for id in chain.chain(shown).chain(deeper) {
        if ranking.len() == limit {
            break;
        }
        if !ranking.contains(id) {
            ranking.push(id.clone());
        }
    }
    ranking
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_truncated_observation_shows_only_the_hits_whose_line_survived_the_cut() {
        let hits = [Hit { id: "d1", title: "One", text: "first" }, Hit { id: "d2", title: "Two", text: "second" }];
        let text = search_results("bm25_search", "q", &hits);
        let cut = &text[..text.find("doc_id: d2").unwrap()];
        assert!(shows(&text, false, "d2") && shows(cut, false, "d2"), "an untruncated observation shows every hit");
        assert!(shows(cut, true, "d1"));
        assert!(!shows(cut, true, "d2"));
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
        let text = "Klabou Atelier. Started by Ada Varnok.".into();
        assert_eq!(listed[0], ListedHit { id: "o3".into(), title: "Klabou Atelier".into(), text });
        assert_eq!(listed[1].id, "p3");
        assert!(listed[1].text.ends_with("..."), "{}", listed[1].text);
        assert_eq!(search_results("bm25_search", "q", &[]), "bm25_search found no documents for \"q\".");
    }

    #[test]
    fn leads_are_listed_numbered_and_read_back_apart_from_the_hits() {
        let hits = [Hit { id: "o3", title: "Klabou Atelier", text: "Started by Ada Varnok." }];
        let observation = search_results("bm25_search", "q", &hits);
        let leads: Vec<String> = [" Ada Varnok", " regatta", " v1.2", " Klougi"].map(String::from).to_vec();
        let listed = with_leads(&observation, &leads);
        assert!(listed.ends_with("Varnok.\nLeads to follow: 1. Ada Varnok; 2. regatta; 3. v1.2\n"), "{listed}");
        assert_eq!(parse_leads(&listed), ["Ada Varnok", "regatta", "v1.2"]);
        assert_eq!(parse_search_results(&listed), parse_search_results(&observation));
        assert_eq!(with_leads(&observation, &[]), observation);
        assert!(parse_leads(&observation).is_empty());
        assert_eq!(with_leads("cut off", &leads[..1]), "cut off\nLeads to follow: 1. Ada Varnok\n");
    }

    #[test]
    fn the_searched_ranking_puts_the_latest_search_first_and_each_document_once() {
        let searched = |ids: &[&str], shown: usize| Searched {
            ids: ids.iter().map(|id| (*id).to_owned()).collect(),
            shown,
            ..Default::default()
        };
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
        let opening = [Searched { ids: top.clone(), shown: 5, ..Default::default() }];
        assert_eq!(ranking(&opening, 10), top[..10].to_vec());
    }

    #[test]
    fn a_chain_of_followed_leads_ranks_its_end_and_links_first() {
        let searched = |ids: &[&str], link: Option<&str>| Searched {
            ids: ids.iter().map(|id| (*id).to_owned()).collect(),
            shown: 5,
            link: link.map(str::to_owned),
        };
        let ids = |ids: &[&str]| ids.iter().map(|id| (*id).to_owned()).collect::<Vec<_>>();
        // An incident names a service, whose page names its team.
        let searches = [
            searched(&["note", "incident", "x1", "x2", "x3"], None),
            searched(&["other", "service", "y1", "y2", "y3"], Some("incident")),
            searched(&["team", "z1", "z2", "z3", "z4"], Some("service")),
        ];
        let ranked = ranking(&searches, 10);
        assert_eq!(ranked[..3], ids(&["team", "service", "incident"]));
        assert_eq!(ranked[3..], ids(&["z1", "z2", "z3", "z4", "other", "y1", "y2"]));
    }
}
