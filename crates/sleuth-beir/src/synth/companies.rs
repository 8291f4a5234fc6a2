//! The companies family: a small world of companies, their founders, the
//! towns they live in and the rivers beside those towns, with questions
//! that need 1 to 3 searches.
//!
//! - **product** (1 search): "What does Velmor Works produce?" names the
//!   company; its document answers.
//! - **founder_craft**, **founder_town** (2 searches): the company's document
//!   names its founder (the bridge), whose document answers.
//! - **founder_river** (3 searches): company -> founder -> the founder's town,
//!   whose document names the river.
//!
//! Distractors share the questions' vocabulary: news items that name a
//! company or a person beside another town, so BM25 on the question alone
//! ranks them high. A company's questions all go to one split, and each
//! split has towns of its own, where its companies' founders live. Names
//! are capitalised made-up words.

use super::{Names, Question, Rng, World, draw_split, in_split, places};

const CRAFTS: &[&str] = &[
    "glassblower",
    "clockmaker",
    "cartographer",
    "weaver",
    "luthier",
    "bookbinder",
    "potter",
    "tanner",
    "cooper",
    "engraver",
    "chandler",
    "milliner",
];
const PRODUCTS: &[&str] = &[
    "copper kettles",
    "paper lanterns",
    "wool blankets",
    "brass compasses",
    "oak barrels",
    "silk ribbons",
    "clay tiles",
    "steel needles",
    "linen sails",
    "tin whistles",
    "leather saddles",
    "cedar chests",
];
const SUFFIXES: &[&str] = &["Works", "Foundry", "Mills", "Guild", "Company", "Atelier"];
const FEATURES: &[&str] = &[
    "under steep hills",
    "amid orchards",
    "by salt marshes",
    "below pine forests",
    "among vineyards",
    "facing the sea cliffs",
];
const GOODS: &[&str] = &["apples", "honey", "cheese", "olives", "herring", "barley", "walnuts", "plums"];
const EVENTS: &[&str] = &["regatta", "harvest fair", "lantern parade", "chess tournament", "choir festival"];
const TOPICS: &[&str] = &["apprenticeships", "old tools", "market prices", "river trade", "guild law"];

/// Every word the document and question templates use (names must differ).
const TEMPLATE_WORDS: &[&str] = &[
    "started",
    "makes",
    "lives",
    "earns",
    "living",
    "quiet",
    "enjoys",
    "evenings",
    "lies",
    "beside",
    "markets",
    "sell",
    "sponsored",
    "held",
    "during",
    "gave",
    "talk",
    "about",
    "produce",
    "trade",
    "practise",
    "person",
    "established",
    "town",
    "founder",
    "name",
    "river",
    "near",
    "residence",
    "home",
];

struct City {
    name: String,
    river: String,
    feature: &'static str,
    goods: &'static str,
}

struct Person {
    first: String,
    last: String,
    town: usize,
    craft: &'static str,
}

impl Person {
    fn name(&self) -> String {
        format!("{} {}", self.first, self.last)
    }
}

struct Company {
    name: String,
    founder: usize,
    product: &'static str,
    year: u32,
}

/// The world of `companies` companies (one founder each), drawn from `rng`.
pub(crate) fn world(rng: &mut Rng, companies: usize) -> World {
    let mut names = Names::new(TEMPLATE_WORDS.iter().copied());
    let split_of: Vec<&str> = (0..companies).map(|_| draw_split(rng)).collect();
    let town_split = places(rng, companies / 4);
    let cities: Vec<City> = (0..town_split.len())
        .map(|_| City {
            name: names.fresh(rng, 2),
            river: names.fresh(rng, 2),
            feature: rng.pick(FEATURES),
            goods: rng.pick(GOODS),
        })
        .collect();
    let people: Vec<Person> = (0..companies)
        .map(|i| {
            let home = in_split(&town_split, split_of[i]);
            Person {
                first: names.fresh(rng, 2),
                last: names.fresh(rng, 3),
                town: home[rng.below(home.len())],
                craft: rng.pick(CRAFTS),
            }
        })
        .collect();
    let companies: Vec<Company> = (0..companies)
        .map(|i| Company {
            name: format!("{} {}", names.fresh(rng, 2), rng.pick(SUFFIXES)),
            founder: i,
            product: rng.pick(PRODUCTS),
            year: 1820 + rng.below(180) as u32,
        })
        .collect();

    // (key, title, text): keys name what a document is (`o3`, the third
    // company); the corpus gets opaque ids instead.
    let mut corpus: Vec<(String, String, String)> = Vec::new();
    let mut document = |key: &str, title: &str, text: &str| corpus.push((key.into(), title.into(), text.into()));
    let city_text =
        |c: &City| format!("{} lies beside the {}, {}. Its markets sell {}.", c.name, c.river, c.feature, c.goods);
    let person_text = |p: &Person| {
        let town = &cities[p.town].name;
        format!("{} lives in {town} and earns a living as a {}. {} enjoys quiet evenings.", p.name(), p.craft, p.first)
    };
    let company_text = |c: &Company| {
        format!("{} was started by {} in {}. It makes {}.", c.name, people[c.founder].name(), c.year, c.product)
    };
    for (i, city) in cities.iter().enumerate() {
        document(&format!("c{i}"), &city.name, &city_text(city));
    }
    for (i, person) in people.iter().enumerate() {
        document(&format!("p{i}"), &person.name(), &person_text(person));
        // A distractor naming the person beside another town.
        let elsewhere = &cities[(person.town + 1 + rng.below(cities.len() - 1)) % cities.len()].name;
        let text = format!("{} gave a talk about {} in {elsewhere}.", person.name(), rng.pick(TOPICS));
        document(&format!("dp{i}"), &person.name(), &text);
    }
    for (i, company) in companies.iter().enumerate() {
        document(&format!("o{i}"), &company.name, &company_text(company));
        // A distractor naming the company beside another town and person-like detail.
        let town = &cities[rng.below(cities.len())].name;
        let text = format!(
            "{} sponsored the {} held in {town} during {}.",
            company.name,
            rng.pick(EVENTS),
            1900 + rng.below(120)
        );
        document(&format!("do{i}"), &company.name, &text);
    }

    let mut questions = Vec::new();
    for (i, company) in companies.iter().enumerate() {
        let founder = &people[company.founder];
        let (org, person, city) = (format!("o{i}"), format!("p{}", company.founder), format!("c{}", founder.town));
        let town = &cities[founder.town];
        let mut ask =
            |kind: &'static str, text: String, judged: Vec<(String, i32)>, answer_text: String, answer: &str| {
                let (split, id, answer) = (split_of[i], format!("q{i}-{kind}"), answer.to_owned());
                questions.push(Question { split, id, kind, text, judged, answer_text, answer });
            };
        ask(
            "product",
            format!("What does {} produce?", company.name),
            vec![(org.clone(), 2)],
            company_text(company),
            company.product,
        );
        ask(
            "founder_craft",
            format!("What trade does the person who established {} practise?", company.name),
            vec![(person.clone(), 2), (org.clone(), 1)],
            person_text(founder),
            founder.craft,
        );
        ask(
            "founder_town",
            format!("Which town is home to the founder of {}?", company.name),
            vec![(person.clone(), 2), (org.clone(), 1)],
            person_text(founder),
            &town.name,
        );
        ask(
            "founder_river",
            format!("Name the river near the residence of the founder of {}.", company.name),
            vec![(city, 2), (person, 1), (org, 1)],
            city_text(town),
            &town.river,
        );
    }
    World { corpus, questions }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use crate::synth::{Family, SynthSpec, Synthesized, write};

    fn made(seed: u64) -> (tempfile::TempDir, Synthesized) {
        let dir = tempfile::tempdir().unwrap();
        let summary = write(dir.path(), SynthSpec { family: Family::Companies, seed, size: 40 }).unwrap();
        (dir, summary)
    }

    #[test]
    fn the_same_seed_writes_the_same_bytes_and_another_does_not() {
        let read = |dir: &Path| {
            ["corpus.jsonl", "queries.jsonl", "qrels/test.tsv"].map(|f| std::fs::read(dir.join(f)).unwrap())
        };
        let ((a, _), (b, _), (c, _)) = (made(7), made(7), made(8));
        assert_eq!(read(a.path()), read(b.path()));
        assert_ne!(read(a.path()), read(c.path()));
    }

    #[test]
    fn every_seed_keeps_the_multi_hop_promise() {
        for seed in 0..50 {
            let dir = tempfile::tempdir().unwrap();
            write(dir.path(), SynthSpec { family: Family::Companies, seed, size: 8 }).unwrap();
        }
    }

    #[test]
    fn every_split_and_type_is_there_with_graded_qrels() {
        let (dir, summary) = made(3);
        assert_eq!(summary.types.values().sum::<usize>(), 160);
        assert_eq!(summary.types.len(), 4);
        assert!(summary.questions.values().all(|&n| n > 0), "{summary:?}");
        assert_eq!(summary.documents, 10 + 40 * 4);
        let beir = crate::BeirDir::new(dir.path());
        assert_eq!(beir.queries(crate::BadLines::Fail).unwrap().len(), 160);
        let mut judged = 0;
        for split in ["train", "validation", "test"] {
            for (query, docs) in beir.qrels(split).unwrap() {
                assert_eq!(docs.values().filter(|&&g| g == 2).count(), 1, "{query}: one answer");
                let hops = if query.ends_with("product") {
                    1
                } else if query.ends_with("river") {
                    3
                } else {
                    2
                };
                assert_eq!(docs.len(), hops, "{query}: {docs:?}");
                judged += 1;
            }
        }
        assert_eq!(judged, 160, "every question judged in exactly one split");
    }

    #[test]
    fn no_document_answers_questions_of_two_splits_and_ids_say_nothing() {
        let (dir, _) = made(11);
        let beir = crate::BeirDir::new(dir.path());
        let mut split_of_answer: BTreeMap<String, &str> = BTreeMap::new();
        for split in ["train", "validation", "test"] {
            for docs in beir.qrels(split).unwrap().values() {
                for doc in docs.iter().filter(|(_, g)| **g == 2).map(|(d, _)| d) {
                    let first = *split_of_answer.entry(doc.clone()).or_insert(split);
                    assert_eq!(first, split, "{doc} answers questions of {first} and {split}");
                }
            }
        }
        let ids: Vec<String> = beir.corpus(crate::BadLines::Fail).unwrap().map(|d| d.unwrap().id).collect();
        assert!(ids.iter().all(|id| id.len() == 8 && id.bytes().all(|b| b.is_ascii_hexdigit())), "{ids:?}");
    }

    #[test]
    fn each_hop_names_the_next_and_the_question_names_only_the_first() {
        let (dir, _) = made(5);
        let beir = crate::BeirDir::new(dir.path());
        let corpus: BTreeMap<String, (String, String)> = beir
            .corpus(crate::BadLines::Fail)
            .unwrap()
            .map(|d| d.map(|d| (d.id, (d.title, d.text))))
            .collect::<Result<_, _>>()
            .unwrap();
        let queries = beir.queries(crate::BadLines::Fail).unwrap();
        let all: crate::Qrels = ["train", "validation", "test"].iter().flat_map(|s| beir.qrels(s).unwrap()).collect();
        for question in queries.iter().filter(|q| q.id.ends_with("founder_river")) {
            let judged: Vec<(&(String, String), i32)> =
                all[&question.id].iter().map(|(d, grade)| (&corpus[d], *grade)).collect();
            let find = |grade: i32, named: bool| {
                judged.iter().find(|(d, g)| *g == grade && question.text.contains(&d.0) == named).unwrap().0
            };
            // The answer (grade 2) is the town; of the bridges, the question names the company.
            let (company, founder, town) = (find(1, true), find(1, false), find(2, false));
            assert!(company.1.contains(&founder.0), "{} names its founder {}", company.1, founder.0);
            assert!(founder.1.contains(&town.0), "{} names the town {}", founder.1, town.0);
            assert!(question.text.contains(&company.0), "{} names the company", question.text);
            for later in [&founder.0, &town.0] {
                assert!(later.split(' ').all(|w| !question.text.contains(w)), "{} names {later}", question.text);
            }
        }
    }
}
